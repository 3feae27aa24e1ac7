// The --device flag shared by subcommands (commands.hpp).
#include "attn/core/device.hpp"
#include "attn/core/error.hpp"
#include "tools/attn/commands.hpp"

namespace attn::cli {

void add_device_option(CLI::App* sub, const std::string& command, std::string* device) {
  sub->add_option_function<std::string>(
         "--device",
         [command, device](const std::string& name) {
           // parse_device names the build option when CUDA is not built in.
           const Device d = parse_device(name);
           if (device != nullptr) {
             *device = name;
             return;
           }
           if (d == Device::kCuda)
             throw Error(command, "--device cuda: the CUDA kernels are built in, but the " +
                                      command +
                                      " path on the GPU is not written yet (docs/gpu.md)");
         },
         "cpu (default); cuda needs a build with -DATTN_WITH_CUDA=ON")
      ->default_str("cpu");
}

}  // namespace attn::cli
