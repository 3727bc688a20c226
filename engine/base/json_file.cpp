#include "autotp/base/json_file.h"

#include <fstream>

#include "autotp/base/error.h"

namespace autotp {

nlohmann::json read_json_file(const std::string& path, const std::string& what) {
  std::ifstream in(path);
  AUTOTP_USER_CHECK(in.good(), "{}: cannot open {}", path, what);
  try {
    nlohmann::json j;
    in >> j;
    return j;
  } catch (const nlohmann::json::exception& e) {
    throw_user_error("{}: invalid JSON ({})", path, e.what());
  }
}

}  // namespace autotp
