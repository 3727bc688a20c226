// docs/cli.md documents every option of every subcommand: the options are read
// from `autotp --help` and `autotp NAME --help`, so a new flag without docs fails.
#include <gtest/gtest.h>

#include <regex>
#include <set>
#include <string>

#include "support/cli_runner.h"

namespace autotp {
namespace {

// The subcommand names listed under "Subcommands:" of `autotp --help`.
std::vector<std::string> subcommands() {
  auto help = test::run_cli("--help");
  EXPECT_EQ(help.exit_code, 0) << help.output;
  std::vector<std::string> names;
  const auto at = help.output.find("Subcommands:");
  if (at == std::string::npos) return names;
  static const std::regex line(R"(\n  ([a-z][a-z0-9-]*)\s)");
  for (std::sregex_iterator it(help.output.begin() + at, help.output.end(), line), end; it != end; ++it)
    names.push_back((*it)[1]);
  return names;
}

// The long options a --help text prints (--help itself left out).
std::set<std::string> long_options(const std::string& help) {
  std::set<std::string> flags;
  static const std::regex option(R"(\n\s+(?:-[A-Za-z],)?(--[a-z0-9][a-z0-9-]*))");
  for (std::sregex_iterator it(help.begin(), help.end(), option), end; it != end; ++it)
    if ((*it)[1] != "--help") flags.insert((*it)[1]);
  return flags;
}

// The text of docs/cli.md between "## autotp NAME" and the next "## " heading.
std::string section(const std::string& doc, const std::string& name) {
  const std::string heading = "\n## autotp " + name + "\n";
  const auto begin = doc.find(heading);
  if (begin == std::string::npos) return "";
  const auto end = doc.find("\n## ", begin + heading.size());
  return doc.substr(begin, end == std::string::npos ? std::string::npos : end - begin);
}

TEST(CliDocs, EveryOptionOfEverySubcommandIsInDocsCli) {
  const std::string doc = "\n" + test::read_file(std::string(AUTOTP_SOURCE_DIR) + "/docs/cli.md");
  const auto names = subcommands();
  ASSERT_GE(names.size(), 10u) << "the subcommand list of autotp --help was not found";
  for (const auto& name : names) {
    const std::string text = section(doc, name);
    EXPECT_FALSE(text.empty()) << "docs/cli.md has no section '## autotp " << name << "'";
    if (text.empty()) continue;
    auto help = test::run_cli(name + " --help");
    ASSERT_EQ(help.exit_code, 0) << help.output;
    const auto flags = long_options(help.output);  // none for `presets`: the section alone is checked
    for (const auto& flag : flags)
      EXPECT_NE(text.find("`" + flag), std::string::npos)
          << "docs/cli.md, section 'autotp " << name << "', does not document " << flag;
  }
}

}  // namespace
}  // namespace autotp
