/* The upstream library's file names (torch_memory_saver_hook_mode_{preload,torch}{,_cu12,_cu13}.abi3.so): shims. */
/*
 * A shim holds no state: it needs the real library of its variant beside the
 * package (rpath $ORIGIN/torch_memory_saver), so whichever name a process
 * preloads or dlopens, the loader maps the one real file and Python's import,
 * ctypes and the hooks share one core. A preload shim also defines
 * the interposed functions, forwarding to the real library's routers: on
 * LD_PRELOAD it sits before the executable's own dependencies (libcudart of a
 * C program), where the library it needs does not.
 */
/* Launchers test a library's features by searching the file they are given
 * for the variables it reads (slime looks for TMS_INIT_ENABLE_DISK_BACKUP in
 * the preload library before asking for disk backup); a shim is that file. */
static const char reads_environment[] __attribute__((used)) =
    "TMS_INIT_ENABLE TMS_INIT_ENABLE_CPU_BACKUP TMS_INIT_CPU_BACKUP_BACKEND TMS_RETAIN_CPU_BACKUP "
    "TMS_INIT_ENABLE_DISK_BACKUP TMS_DISK_BACKUP_DIR TMS_DISK_BACKUP_CHUNK_MB TMS_DISK_BACKUP_TRUST_DIR";

#ifdef TMS_SHIM_PRELOAD
#include "hooks/hook_forward.h"

TMS_DEFINE_ALLOCATOR_HOOKS(cudaMalloc, cudaFree, tms_preload_malloc, tms_preload_free)
TMS_DEFINE_ALLOCATOR_HOOKS(hipMalloc, hipFree, tms_preload_malloc, tms_preload_free)
TMS_DEFINE_ENTRY_POINT_HOOKS(tms_preload_entry_point)
#include "hooks/ipc.h"
TMS_DEFINE_IPC_HOOKS("default")
#else
static const char shim_of[] __attribute__((used)) = "torch_memory_saver torch-mode library";
#endif
