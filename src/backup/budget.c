/* The host backup budget of a backed-up pause: what it reserves, what spills to disk, what each backup holds after. */
#include "backup/save.h"

#include <stdlib.h>

#include "backup/ledger.h"

static size_t planned_bytes(const struct tms_save_plan *p)
{
    if (!p->m->ranges) return p->m->size;
    size_t n = 0;
    for (size_t r = 0; r < p->m->n_ranges; r++) n += p->m->ranges[r].len;
    return n;
}

/* The budget the plan's backup holds now, if the pause reuses it. */
static size_t held_now(const struct tms_save_plan *p)
{
    return p->m->held && p->m->held->kind == p->m->kind ? p->m->held->reserved : 0;
}

static int by_need_desc(const void *x, const void *y)
{
    const struct tms_save_plan *a = *(struct tms_save_plan *const *)x, *b = *(struct tms_save_plan *const *)y;
    return (a->need < b->need) - (a->need > b->need);
}

int tms_budget_reserve(struct tms_save_plan *p, size_t n, int spill, size_t *reserved, struct tms_err *err)
{
    size_t need = 0, room = 0, candidates = 0;
    *reserved = 0;
    for (size_t i = 0; i < n; i++) {
        p[i].need = 0;
        if (!tms_backup_kind_is_host(p[i].m->kind)) continue;
        p[i].need = planned_bytes(&p[i]);
        size_t have = held_now(&p[i]);
        if (p[i].need > have) need += p[i].need - have, candidates++;
    }
    struct tms_err why = {0};
    int rc = tms_ledger_reserve(need, &room, &why);
    if (rc == TMS_OK) {
        *reserved = need;
        return TMS_OK;
    }
    if (rc != TMS_E_HOST_OOM || !spill) {
        if (err) *err = why;
        return rc;
    }
    struct tms_save_plan **order = calloc(candidates ? candidates : 1, sizeof *order);
    if (!order) return tms_fail(err, TMS_E_HOST_OOM, 0, "out of host memory planning %zu backups", candidates);
    size_t k = 0;
    for (size_t i = 0; i < n; i++)
        if (p[i].need > held_now(&p[i])) order[k++] = &p[i];
    qsort(order, k, sizeof *order, by_need_desc);
    for (size_t i = 0; i < k && need > room; i++) {
        order[i]->spill = 1;
        need -= order[i]->need - held_now(order[i]);
    }
    free(order);
    if ((rc = tms_ledger_reserve(need, NULL, err)) == TMS_OK) *reserved = need;
    return rc;
}

void tms_budget_settle(struct tms_save_plan *p, size_t n)
{
    for (size_t i = 0; i < n; i++) {
        struct tms_backup *b = p[i].m->copy;
        if (!b || !tms_backup_kind_is_host(b->kind)) continue;
        if (b->reserved > p[i].need) tms_ledger_release(b->reserved - p[i].need);
        b->reserved = p[i].need;
    }
}
