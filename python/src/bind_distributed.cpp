// attn.distributed's C++ side: the Communicator (attn/core/comm.hpp) for NumPy arrays, and the
// Reducer behind attn.distributed.DistributedDataParallel (bucketed gradient allreduce started
// while backward runs). python/attn/distributed.py re-exports both with the PyTorch-familiar
// names; docs/python.md ("Data-parallel training") explains the whole loop.
//
// Loading MPI inside Python: CPython loads extension modules with RTLD_LOCAL, so libmpi (a
// dependency of this module when attn was built with MPI) lands in a private symbol scope, and
// Open MPI's plugins (mca_*.so, dlopen'ed by MPI_Init) that expect libmpi's symbols globally
// can fail to load ("undefined symbol: ompi_..."). Before the MPI communicator is created,
// promote_mpi_to_global() re-opens the already loaded libmpi with RTLD_GLOBAL (what mpi4py
// does), so users need no ctypes preloading and nothing changes without mpirun. Debian's Open
// MPI 4.1.4 links its plugins against libmpi and works either way (checked, 2 ranks over shm
// and TCP); the promotion is for MPI builds whose plugins do not.
#include "bindings.hpp"
#include "module_wrapper.hpp"

#include "attn/core/comm.hpp"
#include "attn/core/error.hpp"
#include "attn/nn/transformer.hpp"

#include <dlfcn.h>
#include <link.h>

#include <pybind11/stl.h>

#include <cstring>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

namespace attn::python {
namespace {

// ---------------------------------------------------------------------------------------------
// MPI's symbols into the global scope

int find_libmpi(dl_phdr_info* info, size_t, void* out) {
  const char* name = info->dlpi_name;
  if (name == nullptr || *name == '\0') return 0;
  const char* slash = std::strrchr(name, '/');
  const char* base = slash ? slash + 1 : name;
  if (std::strncmp(base, "libmpi.so", 9) != 0) return 0;  // not libmpi_cxx.so, libmpi_mpifh.so
  *static_cast<std::string*>(out) = name;
  return 1;
}

// Re-opens the loaded libmpi (Open MPI's libmpi.so.40, MPICH's libmpi.so.12) with RTLD_GLOBAL.
// A no-op when no libmpi is loaded (attn built without MPI).
void promote_mpi_to_global() {
  static bool done = false;  // under the GIL
  if (done) return;
  done = true;
  std::string path;
  dl_iterate_phdr(find_libmpi, &path);
  if (path.empty()) return;
  // RTLD_NOLOAD: only change the scope of the copy already loaded; the handle is kept (never
  // dlclose'd) so that libmpi stays global for the life of the process.
  void* handle = dlopen(path.c_str(), RTLD_NOW | RTLD_GLOBAL | RTLD_NOLOAD);
  check(handle != nullptr, "world", "could not make {} global (dlopen: {})", path,
        dlerror() ? dlerror() : "unknown error");
}

// ---------------------------------------------------------------------------------------------
// Arrays for collectives

struct PyComm {
  std::shared_ptr<Communicator> comm;
};

enum class PyReduce : uint8_t { kSum, kMean, kMin, kMax };

PyReduce parse_reduce(const std::string& op, const char* where) {
  if (op == "sum") return PyReduce::kSum;
  if (op == "mean" || op == "avg") return PyReduce::kMean;
  if (op == "min") return PyReduce::kMin;
  if (op == "max") return PyReduce::kMax;
  throw Error(where,
              fmt::format("op '{}' unsupported; expected 'sum', 'mean', 'min' or 'max'", op));
}

std::string shape_text(const py::array& a) {
  std::string s = "(";
  for (py::ssize_t i = 0; i < a.ndim(); ++i)
    s += (i ? ", " : "") + std::to_string(a.shape(i)) + (a.ndim() == 1 ? "," : "");
  return s + ")";
}

enum class Accept : uint8_t { kFloat, kFloatOrI64, kAny };

// The array behind `obj` for an in-place collective `op`: a NumPy array of float32, float64,
// int64 (kFloatOrI64) or any dtype (kAny: bytes are copied), C-contiguous and writeable, else
// Error naming op, dtype and shape. Its reduction type goes to `type` (kByte for other dtypes).
py::array inplace_array(py::handle obj, const char* op, Accept accept, CommType& type) {
  if (!py::isinstance<py::array>(obj))
    throw Error(op, fmt::format("expects a NumPy array (updated in place), not {}",
                                py::str(py::type::of(obj).attr("__name__")).cast<std::string>()));
  auto a = py::reinterpret_borrow<py::array>(obj);
  const std::string dtype = py::str(a.dtype()).cast<std::string>();
  if (a.dtype().is(py::dtype::of<float>()))
    type = CommType::kF32;
  else if (a.dtype().is(py::dtype::of<double>()))
    type = CommType::kF64;
  else if (accept != Accept::kFloat && a.dtype().is(py::dtype::of<int64_t>()))
    type = CommType::kI64;
  else if (accept == Accept::kAny)
    type = CommType::kByte;
  else
    throw Error(op,
                fmt::format("array of dtype {} and shape {}: expected float32 or float64{}", dtype,
                            shape_text(a), accept == Accept::kFloatOrI64 ? " (or int64)" : ""));
  if (!(a.flags() & py::array::c_style))
    throw Error(op, fmt::format("array of dtype {} and shape {} is not C-contiguous; pass "
                                "np.ascontiguousarray(a) and read the result from that copy",
                                dtype, shape_text(a)));
  if (!a.writeable())
    throw Error(op, fmt::format("array of dtype {} and shape {} is read-only; the collective "
                                "writes its result into it",
                                dtype, shape_text(a)));
  return a;
}

// Every rank passes the same dtype and shape (collective; one small allreduce): else an Error on
// every rank naming this rank's array, instead of MPI mixing different counts.
void check_same_array(Communicator& comm, const char* op, const py::array& a) {
  if (comm.size() == 1) return;
  // NumPy's type number and item size name the dtype.
  std::vector<int64_t> values = {static_cast<int64_t>(a.dtype().num()),
                                 static_cast<int64_t>(a.itemsize()),
                                 static_cast<int64_t>(a.ndim())};
  for (py::ssize_t i = 0; i < a.ndim(); ++i)
    values.push_back(static_cast<int64_t>(a.shape(i)));
  const std::string what = fmt::format(
      "the array's dtype and shape (here {} {}; compared as (NumPy type number, item size, "
      "ndim, dims...))",
      py::str(a.dtype()).cast<std::string>(), shape_text(a));
  without_gil([&] { comm.check_same(op, what, values); });
}

template <typename T>
void scale(T* data, int64_t n, double s) {
  for (int64_t i = 0; i < n; ++i)
    data[i] = static_cast<T>(data[i] * s);
}

py::array allreduce(PyComm& self, py::handle obj, const std::string& op_name) {
  const char* op = "allreduce";
  const PyReduce red = parse_reduce(op_name, op);
  CommType type{};
  py::array a =
      inplace_array(obj, op, red != PyReduce::kMean ? Accept::kFloatOrI64 : Accept::kFloat, type);
  check_same_array(*self.comm, op, a);
  const ReduceOp base = red == PyReduce::kMin   ? ReduceOp::kMin
                        : red == PyReduce::kMax ? ReduceOp::kMax
                                                : ReduceOp::kSum;
  void* data = a.mutable_data();
  const int64_t n = static_cast<int64_t>(a.size());
  without_gil([&] {
    self.comm->allreduce(data, n, type, base);
    if (red == PyReduce::kMean && self.comm->size() > 1) {
      const double s = 1.0 / self.comm->size();
      if (type == CommType::kF32)
        scale(static_cast<float*>(data), n, s);
      else
        scale(static_cast<double*>(data), n, s);
    }
  });
  return a;
}

py::array broadcast(PyComm& self, py::handle obj, int root) {
  const char* op = "broadcast";
  check(root >= 0 && root < self.comm->size(), op, "root {} is outside [0, {})", root,
        self.comm->size());
  CommType type{};
  py::array a = inplace_array(obj, op, Accept::kAny, type);
  check_same_array(*self.comm, op, a);
  void* data = a.mutable_data();
  const int64_t bytes = static_cast<int64_t>(a.nbytes());
  without_gil([&] { self.comm->broadcast(data, bytes, root); });
  return a;
}

// ---------------------------------------------------------------------------------------------
// The Reducer: gradients of a set of modules, in buckets

struct Bucket {
  std::vector<nn::Parameter*> params;
  DType dtype = DType::F32;
  std::vector<float> f32;
  std::vector<double> f64;
  Request request;
  bool started = false;
};

struct Member {
  py::object owner;  // the attn.Module
  PyModule* layer = nullptr;
  nn::TransformerEncoder* encoder = nullptr;  // set when the module is one: a bucket per block
  std::vector<size_t> buckets;                // this module's, in the order backward fills them
};

struct PyReducer {
  std::shared_ptr<Communicator> comm;
  std::vector<Member> members;
  std::vector<Bucket> buckets;
  size_t in_flight = 0;  // buckets started since the last synchronize

  Member& member_of(py::handle module, const char* op) {
    for (Member& m : members)
      if (m.owner.is(module)) return m;
    throw Error(op, fmt::format("{} is not one of the modules this DistributedDataParallel "
                                "wraps",
                                py::repr(module).cast<std::string>()));
  }

  // Packs the bucket's gradients and starts their sum over the ranks (non-blocking).
  void start(Bucket& b) {
    if (b.started) return;
    b.started = true;
    ++in_flight;
    if (comm->size() == 1) return;
    if (b.dtype == DType::F32) {
      float* out = b.f32.data();
      for (const nn::Parameter* p : b.params) {
        const Tensor g = p->grad.contiguous();
        std::copy_n(g.data<float>(), g.numel(), out);
        out += g.numel();
      }
      b.request = comm->iallreduce(std::span<float>(b.f32));
    } else {
      double* out = b.f64.data();
      for (const nn::Parameter* p : b.params) {
        const Tensor g = p->grad.contiguous();
        std::copy_n(g.data<double>(), g.numel(), out);
        out += g.numel();
      }
      b.request = comm->iallreduce(std::span<double>(b.f64));
    }
  }
  // Lets MPI progress the buckets already started (between pieces of backward).
  void poke() {
    for (Bucket& b : buckets)
      if (b.started && b.request.pending()) b.request.test();
  }

  template <typename T>
  static void unpack(const std::vector<T>& buffer, Bucket& b, double s) {
    const T* in = buffer.data();
    for (nn::Parameter* p : b.params) {
      T* g = p->grad.data<T>();
      for (int64_t i = 0; i < p->grad.numel(); ++i)
        g[i] = static_cast<T>(in[i] * s);
      in += p->grad.numel();
    }
  }

  // Starts whatever is not started yet (in bucket order: the same on every rank), waits for all
  // and writes the reduced gradients back (times 1/N when averaging).
  void synchronize(bool average) {
    for (Bucket& b : buckets)
      start(b);
    std::vector<Request> pending;
    for (Bucket& b : buckets)
      if (b.request.pending()) pending.push_back(std::move(b.request));
    try {
      wait_all(pending);
    } catch (...) {
      for (Bucket& b : buckets)
        b.started = false;
      in_flight = 0;
      throw;
    }
    in_flight = 0;
    const double s = average ? 1.0 / comm->size() : 1.0;
    for (Bucket& b : buckets) {
      b.started = false;
      if (comm->size() == 1) {
        if (s != 1.0) {
          for (nn::Parameter* p : b.params) {
            if (b.dtype == DType::F32)
              scale(p->grad.data<float>(), p->grad.numel(), s);
            else
              scale(p->grad.data<double>(), p->grad.numel(), s);
          }
        }
        continue;
      }
      if (b.dtype == DType::F32)
        unpack(b.f32, b, s);
      else
        unpack(b.f64, b, s);
    }
  }
};

void add_bucket(PyReducer& r, Member& m, std::vector<nn::Parameter*> params, DType dtype) {
  if (params.empty()) return;
  Bucket b;
  b.params = std::move(params);
  b.dtype = dtype;
  size_t n = 0;
  for (const nn::Parameter* p : b.params)
    n += static_cast<size_t>(p->grad.numel());
  if (dtype == DType::F32)
    b.f32.resize(n);
  else
    b.f64.resize(n);
  m.buckets.push_back(r.buckets.size());
  r.buckets.push_back(std::move(b));
}

std::unique_ptr<PyReducer> make_reducer(const py::list& modules, const PyComm& comm) {
  const char* op = "DistributedDataParallel";
  auto r = std::make_unique<PyReducer>();
  r->comm = comm.comm;
  check(!modules.empty(), op, "expects at least one attn.Module");
  for (py::handle obj : modules) {
    if (!py::isinstance<PyModule>(obj))
      throw Error(op, fmt::format("expects attn.Module objects (layers), not {}",
                                  py::str(py::type::of(obj).attr("__name__")).cast<std::string>()));
    for (const Member& m : r->members)
      check(!m.owner.is(obj), op, "{} is listed twice", py::repr(obj).cast<std::string>());
    Member m;
    m.owner = py::reinterpret_borrow<py::object>(obj);
    m.layer = &obj.cast<PyModule&>();
    std::lock_guard lock(m.layer->mutex);
    nn::Module& mod = m.layer->module();
    const DType dtype = mod.dtype();
    check(dtype == DType::F32 || dtype == DType::F64, op,
          "{} computes in {}: gradients are reduced in float32 or float64 only (keep float32 "
          "master weights)",
          m.layer->name(), python_dtype_name(dtype));
    auto named = mod.named_parameters();
    for (auto& [name, p] : named)
      check(p->value.defined() && p->grad.defined() && p->grad.is_contiguous(), op,
            "{}'s parameter '{}' does not exist yet (a lazy layer): run one forward, or give "
            "in_features, before wrapping it",
            m.layer->name(), name);
    m.encoder = dynamic_cast<nn::TransformerEncoder*>(&mod);
    r->members.push_back(std::move(m));
    Member& added = r->members.back();
    if (added.encoder != nullptr) {
      // Backward finishes block num_blks-1 first, then the earlier ones, then the embedding and
      // positional table: one bucket each, in that order (as the C++ Trainer's stages).
      const int64_t n = added.encoder->num_blks();
      std::vector<std::vector<nn::Parameter*>> by_block(static_cast<size_t>(n));
      std::vector<nn::Parameter*> rest;
      const std::string prefix = "blks.block";
      for (auto& [name, p] : named) {
        if (name.rfind(prefix, 0) == 0)
          by_block[static_cast<size_t>(std::stoll(name.substr(prefix.size())))].push_back(p);
        else
          rest.push_back(p);
      }
      for (int64_t i = n - 1; i >= 0; --i)
        add_bucket(*r, added, std::move(by_block[static_cast<size_t>(i)]), dtype);
      add_bucket(*r, added, std::move(rest), dtype);
    } else {
      std::vector<nn::Parameter*> all;
      for (auto& [name, p] : named)
        all.push_back(p);
      add_bucket(*r, added, std::move(all), dtype);
    }
  }
  // The same model on every rank: the same buckets (count, dtype, size), or the reductions would
  // mix unrelated gradients (or deadlock on different counts).
  std::vector<int64_t> layout;
  for (const Bucket& b : r->buckets) {
    layout.push_back(static_cast<int64_t>(b.dtype));
    layout.push_back(static_cast<int64_t>(b.dtype == DType::F32 ? b.f32.size() : b.f64.size()));
  }
  without_gil([&] {
    r->comm->check_same(op, "the wrapped modules' gradient buckets (dtype, elements per bucket)",
                        layout);
  });
  // Dropout masks come from (seed, offset, global sample): the same seed and stream offset on
  // every rank, or the ranks would drop different units than one process does.
  std::vector<int64_t> streams;
  for (const Member& m : r->members) {
    streams.push_back(static_cast<int64_t>(m.layer->ctx->ctx.seed));
    streams.push_back(static_cast<int64_t>(m.layer->ctx->ctx.dropout_offset()));
  }
  without_gil([&] {
    r->comm->check_same(op,
                        "the wrapped modules' dropout streams (context seed, dropout_offset per "
                        "module; give every rank the same seed)",
                        streams);
  });
  return r;
}

void broadcast_parameters(PyReducer& r, int root) {
  const char* op = "broadcast_parameters";
  check(root >= 0 && root < r.comm->size(), op, "root {} is outside [0, {})", root, r.comm->size());
  if (r.comm->size() == 1) return;
  for (Member& m : r.members) {
    without_gil([&] {
      std::lock_guard lock(m.layer->mutex);
      for (auto& [name, p] : m.layer->module().named_parameters()) {
        check(p->value.is_contiguous(), op, "parameter '{}' is not contiguous", name);
        r.comm->broadcast(p->value.raw_data(), static_cast<int64_t>(p->value.nbytes()), root);
      }
    });
  }
}

// Runs `module`'s backward with its buckets started as their gradients become final: a
// TransformerEncoder's per block (as each block's backward finishes, while the earlier blocks
// still compute), any other module's all at once when its backward returns.
py::object reducer_backward(PyReducer& r, py::handle module, py::handle grad_output) {
  const char* op = "DistributedDataParallel.backward";
  Member& m = r.member_of(module, op);
  // Its buckets already travel with this step's gradients: a second backward would add to grads
  // that synchronize() then overwrites with the first one's reduction.
  for (size_t i : m.buckets)
    check(!r.buckets[i].started, op,
          "{}'s gradients are already being reduced (a backward through "
          "DistributedDataParallel since the last synchronize()); call synchronize() first, or "
          "accumulate micro-batches with plain {}.backward() calls and one synchronize()",
          m.layer->name(), m.layer->name());
  if (m.encoder == nullptr) {
    py::object result = module.attr("backward")(grad_output);
    without_gil([&] {
      for (size_t i : m.buckets)
        r.start(r.buckets[i]);
      r.poke();
    });
    return result;
  }
  Input d = module_input(grad_output, "TransformerEncoder", "grad_output", m.encoder->dtype());
  const int64_t n = m.encoder->num_blks();
  run_locked(*m.layer, {}, [&](Context& c) {
    m.encoder->backward(c, d.tensor, [&](int64_t blk) {
      r.start(r.buckets[m.buckets[static_cast<size_t>(n - 1 - blk)]]);
      r.poke();
    });
    for (size_t i : m.buckets)  // the embedding's (and any block without parameters)
      r.start(r.buckets[i]);
    return 0;
  });
  return py::none();
}

}  // namespace

void bind_distributed(py::module_& m) {
  py::class_<PyComm>(m, "Communicator", R"doc(
The ranks of one run (attn/core/comm.hpp): rank, size, and collectives on NumPy arrays, in
place. Get it from attn.distributed.world(). Every rank must make the same collective calls in
the same order with arrays of the same dtype and shape (checked: attn.Error on every rank).)doc")
      .def_property_readonly("rank", [](PyComm& c) { return c.comm->rank(); })
      .def_property_readonly("size", [](PyComm& c) { return c.comm->size(); })
      .def_property_readonly(
          "backend", [](PyComm& c) { return std::string(c.comm->name()); },
          "'single' (one process) or 'mpi'.")
      .def("allreduce", &allreduce, py::arg("array"), py::arg("op") = "sum", R"doc(
array[i] = op over the ranks of array[i], in place; returns the array. op: 'sum' (default),
'mean' ('avg'), 'min', 'max'. float32 or float64 (int64 for sum/min/max), C-contiguous,
writeable; the same dtype and shape on every rank.)doc")
      .def("broadcast", &broadcast, py::arg("array"), py::arg("root") = 0,
           "Every rank's array becomes root's (in place; any dtype, C-contiguous, writeable, the "
           "same dtype and shape on every rank); returns the array.")
      .def(
          "barrier", [](PyComm& c) { without_gil([&] { c.comm->barrier(); }); },
          "Returns once every rank has called it.")
      .def(
          "abort", [](PyComm& c, int code) { c.comm->abort(code); }, py::arg("code") = 1,
          "Ends every rank of the run with exit status `code` (MPI_Abort; one process: exit).")
      .def("__repr__", [](PyComm& c) {
        return fmt::format("Communicator(backend='{}', rank={}, size={})", c.comm->name(),
                           c.comm->rank(), c.comm->size());
      });

  m.def(
      "_world",
      [] {
        // Also for `mpirun -np 1`, which initialises MPI (and loads its plugins) too.
        if (mpi_available()) promote_mpi_to_global();
        return PyComm{world_communicator()};
      },
      "The run's communicator (see attn.distributed.world).");
  m.def(
      "_single_process", [] { return PyComm{single_process_communicator()}; },
      "A fresh single-process communicator (rank 0 of 1).");
  m.def("_mpi_available", &mpi_available, "True when attn was built with MPI.");
  m.def("_launcher_world_size", &launcher_world_size,
        "The size an MPI launcher announced in the environment (1 without one).");

  py::class_<PyReducer>(m, "_Reducer")
      .def(py::init(&make_reducer), py::arg("modules"), py::arg("comm"))
      .def("backward", &reducer_backward, py::arg("module"), py::arg("grad_output"))
      .def(
          "synchronize",
          [](PyReducer& r, bool average) { without_gil([&] { r.synchronize(average); }); },
          py::arg("average") = true)
      .def("broadcast_parameters", &broadcast_parameters, py::arg("root") = 0)
      .def_property_readonly(
          "in_flight", [](PyReducer& r) { return r.in_flight; },
          "Buckets started since the last synchronize().")
      .def_property_readonly("bucket_sizes", [](PyReducer& r) {
        std::vector<int64_t> out;
        for (const Bucket& b : r.buckets)
          out.push_back(static_cast<int64_t>(b.dtype == DType::F32 ? b.f32.size() : b.f64.size()));
        return out;
      });
}

}  // namespace attn::python
