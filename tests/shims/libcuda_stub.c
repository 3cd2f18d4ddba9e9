/* A stand-in for the CUDA driver's libcuda.so.1, for the fork server's self-check
 * (tests/test_forkserver.py): cuInit(0) returns 0 in the process that loaded the library and 3
 * (CUDA_ERROR_NOT_INITIALIZED) in a child forked from it, as the real driver fails in a child of a
 * process that started it. Here loading stands for starting: a server that had it loaded before it
 * forks (LD_PRELOAD) must refuse to fork trainers; one that did not (a child loads its own) serves.
 * Built by the test: cc -shared -fPIC -o libcuda.so.1 libcuda_stub.c
 */
#include <unistd.h>

static pid_t loaded_by;

__attribute__((constructor)) static void on_load(void) { loaded_by = getpid(); }

int cuInit(unsigned int flags) {
    (void)flags;
    return getpid() == loaded_by ? 0 : 3;
}
