// Train from the artifacts of relaxgrad's Trainer.export with TVM's C++ runtime alone.
//
//   train <artifacts folder> <data file> <steps> <output state file>
//
// The data file is a TVM parameter file (tvm.runtime.save_param_dict) holding the model's
// inputs by name and "target", with rows on the first axis; step i trains on rows
// [i * batch, (i + 1) * batch), starting over at the end. The state file is read from and
// written in relaxgrad's state format (TVM's parameter file plus a JSON entry), which
// Trainer.load resumes from. A step is the two calls of the manifest's "functions":
//   (out, grads) = loss_adjoint(*arguments, target)
//   (params, optim, (norm,)) = optimizer(params, grads, optim, controls)
// controls are the learning rate, the clipping norm and a gradient multiplier (0-d float32
// tensors): the manifest's "controls" lr and max_norm (null: no clipping); artifacts with a
// learning-rate schedule or a float16 loss scale are the Python runner's. A step whose loss or
// gradient norm is not finite stops the program, the state file untouched. Frozen weights (a
// LoRA base's) are read from the manifest's "frozen" file and not written back. CPU artifacts
// only (no buffers updated by the model), float32 parameters.
#include <dlpack/dlpack.h>
#include <tvm/ffi/container/array.h>
#include <tvm/ffi/container/map.h>
#include <tvm/ffi/extra/json.h>
#include <tvm/ffi/extra/module.h>
#include <tvm/ffi/container/tensor.h>
#include <tvm/ffi/function.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

namespace ffi = tvm::ffi;
using ffi::Tensor;
using Params = ffi::Map<ffi::String, Tensor>;

static const char* kMeta = "__relaxgrad_meta__";

struct CPUAlloc {  // host memory for the tensors made here
  void AllocData(DLTensor* t) {
    t->data = std::aligned_alloc(64, (ffi::GetDataSize(*t) + 63) / 64 * 64);
  }
  void FreeData(DLTensor* t) { std::free(t->data); }
};

static Tensor Empty(std::vector<int64_t> shape, DLDataType dtype) {
  return Tensor::FromNDAlloc(CPUAlloc(), ffi::Shape(shape), dtype, DLDevice{kDLCPU, 0});
}

static ffi::Function Global(const char* name) {
  return ffi::Function::GetGlobal(name).value();
}

static std::string ReadText(const std::string& path) {
  std::ifstream in(path);
  std::stringstream text;
  text << in.rdbuf();
  return text.str();
}

static std::string Str(const ffi::Any& value) { return value.cast<ffi::String>(); }

// Rows [start, start + count) of data (CPU), wrapping around its first axis.
static Tensor Rows(const Tensor& data, int64_t start, int64_t count) {
  std::vector<int64_t> shape(data.shape().begin(), data.shape().end());
  int64_t rows = shape[0];
  shape[0] = count;
  Tensor out = Empty(shape, data.dtype());
  size_t row_bytes = (data.numel() / rows) * ((data.dtype().bits * data.dtype().lanes + 7) / 8);
  for (int64_t i = 0; i < count; ++i) {
    std::memcpy(static_cast<char*>(out.data_ptr()) + i * row_bytes,
                static_cast<char*>(data.data_ptr()) + ((start + i) % rows) * row_bytes, row_bytes);
  }
  return out;
}

int main(int argc, char** argv) {
  if (argc != 5) {
    std::fprintf(stderr, "usage: %s <artifacts folder> <data file> <steps> <output state>\n",
                 argv[0]);
    return 2;
  }
  std::string folder = argv[1];
  int steps = std::stoi(argv[3]);
  ffi::json::Object manifest =
      ffi::json::Parse(ReadText(folder + "/manifest.json")).cast<ffi::json::Object>();
  ffi::json::Object functions = manifest["functions"].cast<ffi::json::Object>();
  ffi::json::Array arguments = manifest["arguments"].cast<ffi::json::Array>();
  ffi::json::Array param_names = manifest["params"].cast<ffi::json::Array>();
  ffi::json::Array optim_names = manifest["optim"].cast<ffi::json::Array>();
  if (Str(manifest["device"]) != "cpu" || !manifest["updates"].cast<ffi::json::Array>().empty()) {
    std::fprintf(stderr, "this example runs CPU artifacts without buffer updates\n");
    return 2;
  }

  // The VM: load the library, create the executable's VM, one CPU device, pooled allocator.
  ffi::Module lib = ffi::Module::LoadFromFile(folder + "/" + Str(manifest["library"]));
  ffi::Module vm = lib->GetFunction("vm_load_executable").value()().cast<ffi::Module>();
  vm->GetFunction("vm_initialization").value()(static_cast<int>(kDLCPU), 0, 2);
  ffi::Function loss_adjoint = vm->GetFunction(Str(functions["loss_adjoint"])).value();
  ffi::Function optimizer = vm->GetFunction(Str(functions["optimizer"])).value();

  // The state and the data.
  Params state = Global("runtime.LoadParamsFromFile")(folder + "/" + Str(manifest["state"]))
                     .cast<Params>();
  Params data = Global("runtime.LoadParamsFromFile")(std::string(argv[2])).cast<Params>();
  Params frozen;  // the buffers no step replaces, by argument name
  if (manifest["frozen"] != nullptr) {
    frozen = Global("runtime.LoadParamsFromFile")(folder + "/" + Str(manifest["frozen"]))
                 .cast<Params>();
  }
  ffi::Array<Tensor> params, optim;
  for (const ffi::Any& name : param_names) params.push_back(state["param:" + Str(name)]);
  for (const ffi::Any& name : optim_names) optim.push_back(state[Str(name)]);
  int64_t batch = manifest["batch_size"].cast<int64_t>();
  ffi::json::Object control = manifest["controls"].cast<ffi::json::Object>();
  if (control["schedule"] != nullptr || control["loss_scale"].cast<bool>()) {
    std::fprintf(stderr, "this example trains at a constant learning rate, without a schedule "
                         "or a float16 loss scale\n");
    return 2;
  }
  float max_norm = control["max_norm"] == nullptr ? INFINITY : control["max_norm"].cast<double>();
  ffi::Array<Tensor> controls;
  for (float value : {static_cast<float>(control["lr"].cast<double>()), max_norm, 1.0f}) {
    Tensor scalar = Empty({}, DLDataType{kDLFloat, 32, 1});
    *static_cast<float*>(scalar.data_ptr()) = value;
    controls.push_back(scalar);
  }

  for (int step = 0; step < steps; ++step) {
    std::vector<ffi::AnyView> args;
    std::vector<Tensor> keep;  // the batch's tensors, alive during the call
    size_t p = 0;
    for (const ffi::Any& item : arguments) {
      ffi::json::Object arg = item.cast<ffi::json::Object>();
      std::string kind = Str(arg["kind"]);
      if (kind == "input") {
        keep.push_back(Rows(data[Str(arg["name"])], step * batch, batch));
      } else if (kind == "buffer") {
        keep.push_back(frozen["buffer:" + Str(arg["name"])]);
      } else {
        keep.push_back(params[p++]);
      }
    }
    keep.push_back(Rows(data["target"], step * batch, batch));
    for (const Tensor& t : keep) args.push_back(t);
    ffi::Any result;
    loss_adjoint.CallPacked(args.data(), static_cast<int>(args.size()), &result);
    ffi::Array<ffi::Any> out = result.cast<ffi::Array<ffi::Any>>();
    Tensor loss = out[0].cast<Tensor>();
    ffi::Array<ffi::Any> updated =
        optimizer(params, out[1], optim, controls).cast<ffi::Array<ffi::Any>>();
    float value = *static_cast<float*>(loss.data_ptr());
    Tensor norm = updated[2].cast<ffi::Array<Tensor>>()[0];
    if (!std::isfinite(value) || !std::isfinite(*static_cast<float*>(norm.data_ptr()))) {
      std::fprintf(stderr, "step %d: the loss or the gradients are not finite\n", step + 1);
      return 3;
    }
    params = updated[0].cast<ffi::Array<Tensor>>();
    optim = updated[1].cast<ffi::Array<Tensor>>();
    std::printf("step %d: loss %.6f\n", step + 1, value);
  }

  // Write the state back: the same names, the step count in the JSON entry advanced.
  ffi::Map<ffi::String, Tensor> out_state;
  for (size_t i = 0; i < params.size(); ++i) {
    out_state.Set("param:" + Str(param_names[i]), params[i]);
  }
  for (size_t i = 0; i < optim.size(); ++i) out_state.Set(Str(optim_names[i]), optim[i]);
  Tensor meta = state[kMeta];
  std::string text(static_cast<char*>(meta.data_ptr()), meta.numel());
  ffi::json::Object info = ffi::json::Parse(text).cast<ffi::json::Object>();
  info.Set(ffi::String("steps"), info["steps"].cast<int64_t>() + steps);
  std::string updated_text = ffi::json::Stringify(info);
  Tensor new_meta = Empty({static_cast<int64_t>(updated_text.size())}, DLDataType{kDLUInt, 8, 1});
  std::memcpy(new_meta.data_ptr(), updated_text.data(), updated_text.size());
  out_state.Set(kMeta, new_meta);
  std::string path = argv[4], tmp = path + ".tmp";
  Global("runtime.SaveParamsToFile")(out_state, tmp);
  return std::rename(tmp.c_str(), path.c_str()) == 0 ? 0 : 1;
}
