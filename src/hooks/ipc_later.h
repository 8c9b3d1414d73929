/* The torch variant's IPC hooks installed beside the caller: the walk of every loaded object's relocations. */
#ifndef TMS_HOOKS_IPC_LATER_H
#define TMS_HOOKS_IPC_LATER_H

#include "platform/error.h"

/* Starts install on a thread of its own (once per process) and returns at once. */
void tms_ipc_hooks_install_later(int (*install)(struct tms_err *err));

/* Waits for an install started later, then runs install (idempotent) in the caller. */
int tms_ipc_hooks_install(int (*install)(struct tms_err *err), struct tms_err *err);

#endif
