# How the MPI tests start their ranks (tests/mpi/CMakeLists.txt, python/CMakeLists.txt).
#
# As root (CI containers), Open MPI refuses to start unless OMPI_ALLOW_RUN_AS_ROOT and
# OMPI_ALLOW_RUN_AS_ROOT_CONFIRM are set; the tests set them. OMP_NUM_THREADS=1: one thread per
# rank, so 4 ranks do not fight over 2 cores with 8 threads.
set(ATTN_MPI_ENV OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMP_NUM_THREADS=1
    OMPI_MCA_rmaps_base_oversubscribe=1)
if(ATTN_SANITIZE MATCHES "address")
  # Open MPI 4.1 leaves ~120 KB in ~3,300 allocations at MPI_Finalize, most of them from MCA and
  # PMIx plugins already unloaded when LeakSanitizer reports (frames "<unknown module>"), so no
  # suppression file can name them. These tests keep ASan's address checks and UBSan; leak
  # detection stays on for every other test. mpirun passes the environment on to local ranks.
  list(APPEND ATTN_MPI_ENV ASAN_OPTIONS=detect_leaks=0)
endif()
# vader's single-copy path (CMA) needs ptrace rights that containers often lack; "none" copies
# through the shared segment instead.
set(ATTN_MPI_SHM --mca btl self,vader --mca btl_vader_single_copy_mechanism none)
# Open MPI leaves loopback out of its TCP interfaces by default; name it.
set(ATTN_MPI_TCP --mca btl self,tcp --mca btl_tcp_if_include lo --mca oob_tcp_if_include lo)

# attn_mpi_command(OUT NP TRANSPORT): OUT = the mpirun command line for NP ranks over TRANSPORT
# (shm|tcp), oversubscribed.
function(attn_mpi_command out np transport)
  if(transport STREQUAL "shm")
    set(btl ${ATTN_MPI_SHM})
  else()
    set(btl ${ATTN_MPI_TCP})
  endif()
  set(${out} ${MPIEXEC_EXECUTABLE} ${MPIEXEC_NUMPROC_FLAG} ${np} --oversubscribe ${btl}
      ${MPIEXEC_PREFLAGS} PARENT_SCOPE)
endfunction()
