/* The host backup budget as one record: the ledger (backup/ledger.c) fills it, the faces show it (core.h's tms_core_host_budget). Declared here, below every layer that passes it, so none keeps a copy of its own. */
#ifndef TMS_HOST_BUDGET_H
#define TMS_HOST_BUDGET_H

#include <stddef.h>

struct tms_ledger_info {
    size_t limit;          /* the budget in bytes, 0 without one */
    size_t reserved;       /* reserved by every live process of the ledger (this one included) */
    size_t mine;           /* reserved by this process */
    size_t mem_total, mem_available;  /* the host's, from /proc/meminfo (0 if unreadable) */
    int safety;            /* without a budget: pauses keep 5 % of the host's memory available */
    int alone;             /* no private place for the ledger: the budget counts this process alone */
    char name[65];
    char ledger[4096];     /* the ledger's file ("" until opened, or alone): PATH_MAX */
};

#endif
