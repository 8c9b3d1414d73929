/* Lending within a job: the processes of one user that name one job and use one GPU pass each other the memory their pauses release. */
#ifndef TMS_SHARE_JOB_H
#define TMS_SHARE_JOB_H

#include <stddef.h>

#include "platform/error.h"

#define TMS_JOB_NAME_MAX 64  /* the job row's longest name (platform/config.h) */

/* Makes the job the core's provider of memory (core_share.h: struct
 * tms_provider): what a pause gives and a resume is provided go through it.
 * Once per process, before its first pause or resume; TMS_JOB names the job
 * until tms_job_set_name says otherwise. */
void tms_job_register(void);

/* Bytes on device this process keeps idle for the job, has lent to other
 * members, and maps from memory other members lent. */
void tms_job_memory(int device, size_t *kept, size_t *lent, size_t *borrowed);

/* The job this process is in ("" for none) into buf. */
void tms_job_get_name(char *buf, size_t size);

/* Joins the job name (NULL or "": none): what TMS_JOB takes (1 to 64
 * letters, digits, '_', '-' or '.', not starting with '.'), else TMS_E_ARG. Once the process took part in the job (a pause or
 * resume asked its members) its name is fixed: another is TMS_E_STATE. */
int tms_job_set_name(const char *name, struct tms_err *err);

#endif
