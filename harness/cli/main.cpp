#include "cli/cli.h"

int main(int argc, char** argv) { return autotp::cli::run(argc, argv); }
