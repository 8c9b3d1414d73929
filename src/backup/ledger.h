/* The host-wide budget of host backups: one ledger the processes of a user share, by name. */
#ifndef TMS_LEDGER_H
#define TMS_LEDGER_H

#include <stddef.h>
#include <stdint.h>

#include "platform/error.h"
#include "platform/host_budget.h"

/* Reserves bytes of host backups for this process, in flight until
 * tms_ledger_copied. With a budget (TMS_HOST_BACKUP_LIMIT), the ledger's live
 * reservations plus bytes must fit it; without one, unless
 * TMS_HOST_MEMORY_SAFETY=0, MemAvailable less the bytes every process of the
 * ledger has in flight must keep 5 % of the host's memory after them. Else
 * TMS_E_HOST_OOM naming the budget, the bytes asked for and the bytes free;
 * *free_bytes (may be NULL) gets those. */
int tms_ledger_reserve(size_t bytes, size_t *free_bytes, struct tms_err *err);
/* The copies of a pause that reserved bytes are over: they are host memory
 * now (MemAvailable counts them) or given back. Call before releasing them. */
void tms_ledger_copied(size_t bytes);
/* Gives back bytes reserved earlier. */
void tms_ledger_release(size_t bytes);
/* The budget now (with one, reads the ledger: a file lock and a read), and
 * where the ledger is (opened if it was not). */
int tms_ledger_info(struct tms_ledger_info *info, struct tms_err *err);

#endif
