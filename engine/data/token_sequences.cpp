#include "autotp/data/token_sequences.h"

#include <nlohmann/json.hpp>

#include <fstream>

#include "autotp/base/error.h"
#include "autotp/base/json_file.h"

namespace autotp {

torch::Tensor read_token_sequences(const std::string& path, int64_t vocab_size) {
  nlohmann::json j = read_json_file(path, "token file");
  AUTOTP_USER_CHECK(j.is_array(), "{}: expected a JSON array of token-id arrays", path);
  AUTOTP_USER_CHECK(!j.empty(), "{}: the file holds no sequences", path);
  const size_t length = j[0].is_array() ? j[0].size() : 0;
  AUTOTP_USER_CHECK(length >= 2, "{}: sequence 0 must be an array of at least 2 token ids", path);
  auto out = torch::empty({static_cast<int64_t>(j.size()), static_cast<int64_t>(length)}, torch::kLong);
  auto acc = out.accessor<int64_t, 2>();
  for (size_t i = 0; i < j.size(); ++i) {
    AUTOTP_USER_CHECK(j[i].is_array(), "{}: sequence {} is not an array", path, i);
    AUTOTP_USER_CHECK(j[i].size() == length,
                      "{}: sequence {} has {} tokens but sequence 0 has {} (all sequences must be equally long)",
                      path, i, j[i].size(), length);
    for (size_t t = 0; t < length; ++t) {
      const auto& v = j[i][t];
      AUTOTP_USER_CHECK(v.is_number_integer(), "{}: sequence {} position {} is not an integer token id", path, i, t);
      int64_t id = v.get<int64_t>();
      AUTOTP_USER_CHECK(id >= 0 && id < vocab_size,
                        "{}: sequence {} position {}: token id {} is outside the vocabulary [0, {})", path, i, t,
                        id, vocab_size);
      acc[i][t] = id;
    }
  }
  return out;
}

}  // namespace autotp
