// A run in which one rank fails, for the fault tests (tests/mpi/CMakeLists.txt): the others are
// inside a collective that the failed rank never joins, and must be stopped, not left waiting.
//
//   mpi_fault throw   rank 1 throws attn::Error; the handler below (what the attn CLI does)
//                     prints it and aborts the run (Communicator::abort -> MPI_Abort)
//   mpi_fault die     rank 1 dies (SIGKILL, no chance to clean up); mpirun ends the others
//
// The test expects a non-zero exit within its timeout and, for `throw`, the error's text.
#include "attn/core/comm.hpp"
#include "attn/core/error.hpp"

#include <csignal>
#include <cstdio>
#include <cstring>
#include <vector>

int main(int argc, char** argv) {
  const char* mode = argc > 1 ? argv[1] : "throw";
  auto comm = attn::world_communicator();
  try {
    std::vector<double> v(1024, 1.0);
    comm->allreduce(std::span<double>(v));  // everyone healthy so far
    if (comm->rank() == 1) {
      if (std::strcmp(mode, "die") == 0) std::raise(SIGKILL);
      throw attn::Error("fault", "rank 1 failed on purpose in the middle of a step");
    }
    comm->allreduce(std::span<double>(v));  // rank 1 never comes: this would wait forever
    std::fprintf(stderr, "rank %d: the collective completed without rank 1\n", comm->rank());
    return 0;
  } catch (const attn::Error& e) {
    std::fprintf(stderr, "attn: rank %d of %d: %s\n", comm->rank(), comm->size(), e.what());
    std::fflush(stderr);
    comm->abort(2);
  }
}
