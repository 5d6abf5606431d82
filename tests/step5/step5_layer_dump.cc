// step5_layer_dump: runs the Step-5 variant's fp32 reference over one prompt
// and writes, for every layer, the residual stream right before and right
// after its attention block, plus every global layer's selected history
// blocks per (token, group). step5_numpy_reference.py recomputes the
// attention blocks from these inputs with its own float64 implementation.
//
//   step5_layer_dump --config tiny-step5 --prompt-len 112 --out PREFIX
//
// Writes PREFIX.json (shapes and byte offsets) and PREFIX.bin (little-endian
// float32 / int32 arrays).

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <string>
#include <vector>

#include "examples/afd_model/model_weights.h"
#include "examples/afd_model/reference.h"
#include "examples/afd_model/step5/step5_config.h"
#include "examples/afd_model/step5/step5_reference.h"

namespace afd::step5 {
namespace {

int Usage() {
  std::fprintf(stderr, "usage: step5_layer_dump --config NAME|PATH --prompt-len N --out PREFIX\n");
  return 2;
}

int Main(int argc, char** argv) {
  std::string config_name = "tiny-step5";
  std::string out;
  int prompt_len = 112;
  for (int i = 1; i < argc; ++i) {
    const std::string flag = argv[i];
    if (i + 1 >= argc) return Usage();
    const char* value = argv[++i];
    if (flag == "--config") {
      config_name = value;
    } else if (flag == "--prompt-len") {
      prompt_len = std::atoi(value);
    } else if (flag == "--out") {
      out = value;
    } else {
      std::fprintf(stderr, "step5_layer_dump: unknown flag %s\n", flag.c_str());
      return Usage();
    }
  }
  if (out.empty() || prompt_len <= 0) return Usage();
  std::string error;
  const auto config = LoadStep5Config(config_name, BundledConfigDir(), &error);
  if (!config) {
    std::fprintf(stderr, "step5_layer_dump: %s\n", error.c_str());
    return 2;
  }
  if (prompt_len > config->model.max_positions) {
    std::fprintf(stderr, "step5_layer_dump: --prompt-len exceeds max_position_embedding\n");
    return 2;
  }

  ReferenceOptions options;
  options.max_seq_len = prompt_len;
  Step5ReferenceModel model(*config, options);
  const std::vector<int32_t> prompt = GeneratePromptTokens(config->model, 1, prompt_len);
  const std::vector<SequenceChunk> chunks = {{0, prompt_len}};
  Step5StepState state;
  state.record_selection = true;
  if (!model.attention().BeginStep(chunks, prompt, &state)) {
    std::fprintf(stderr, "step5_layer_dump: BeginStep failed\n");
    return 1;
  }

  std::vector<char> blob;
  auto append = [&blob](const void* data, size_t bytes) {
    const size_t offset = blob.size();
    blob.resize(offset + bytes);
    std::memcpy(blob.data() + offset, data, bytes);
    return offset;
  };
  std::string layers_json;
  const int64_t h = config->model.hidden_size;
  for (int l = 0; l < config->model.num_layers; ++l) {
    const size_t in = append(state.hidden.data(), sizeof(float) * prompt_len * h);
    state.selection_log.clear();
    model.attention().Attention(l, &state);
    const size_t after = append(state.hidden.data(), sizeof(float) * prompt_len * h);
    std::string selection = "null";
    if (config->is_global_layer[l]) {
      selection = std::to_string(
          append(state.selection_log.data(), sizeof(int32_t) * state.selection_log.size()));
    }
    model.ComputeFfnOutput(l, &state);
    model.attention().AddFfnOutput(&state);
    layers_json += std::string(l == 0 ? "" : ",\n") + "    {\"layer\": " + std::to_string(l) +
                   ", \"global\": " + (config->is_global_layer[l] ? "true" : "false") +
                   ", \"input\": " + std::to_string(in) + ", \"output\": " + std::to_string(after) +
                   ", \"selection\": " + selection + "}";
  }

  std::ofstream bin(out + ".bin", std::ios::binary);
  bin.write(blob.data(), static_cast<std::streamsize>(blob.size()));
  std::ofstream json(out + ".json");
  json << "{\n  \"config\": \"" << config->model.name << "\",\n  \"tokens\": " << prompt_len
       << ",\n  \"hidden\": " << h << ",\n  \"groups\": " << config->num_kv_groups
       << ",\n  \"topk_blocks\": " << config->topk_blocks << ",\n  \"layers\": [\n"
       << layers_json << "\n  ]\n}\n";
  if (!bin || !json) {
    std::fprintf(stderr, "step5_layer_dump: cannot write %s.{bin,json}\n", out.c_str());
    return 1;
  }
  std::printf("step5_layer_dump: %d layers, %d tokens -> %s.{json,bin}\n", config->model.num_layers,
              prompt_len, out.c_str());
  return 0;
}

}  // namespace
}  // namespace afd::step5

int main(int argc, char** argv) { return afd::step5::Main(argc, argv); }
