/* What a pause or resume did, as the faces give it back: one record per call, its byte counts declared once. */
#ifndef TMS_CORE_REPORT_H
#define TMS_CORE_REPORT_H

#include <stddef.h>
#include <stdint.h>

#define TMS_REPORT_DEVICES 16

#define TMS_REPORT_PIDS 4

/* Why a resume in a job took memory from the driver rather than from other
 * members (tms_op_device.fallback). */
enum tms_job_fallback {
    TMS_JOB_NOT_ASKED = 0,   /* no job, or its own kept memory was enough */
    TMS_JOB_NO_MEMBER,       /* no other member of the job on the device */
    TMS_JOB_TIMED_OUT,       /* a member did not answer within the bound (timed_out_pids) */
    TMS_JOB_NOTHING_TO_LEND, /* the members answered, with less than was needed */
    TMS_JOB_ENOUGH,          /* the members lent all that was needed: nothing from the driver */
    TMS_JOB_BAD_LEND,        /* a member lent memory that failed the checks: refused whole (tms_job_note.bad) */
};

/* The byte counts of one device's part of a pause or resume, declared once:
 * X(field, the name the faces give it, what it counts). The C struct below,
 * the dict the Python face returns and Python's Report are made from it. */
#define TMS_REPORT_BYTES(X)                                                                                    \
    X(released, "released_bytes", "bytes of device memory a pause unmapped, or a resume mapped")              \
    X(mapped, "mapped_bytes", "bytes of device memory a resume mapped (0 for a pause)")                       \
    X(copied, "copied_bytes", "bytes copied to (pause) or from (resume) backups")                             \
    X(skipped, "skipped_bytes", "bytes of backed-up allocations not copied: free blocks of PyTorch's cache")  \
    X(unchanged, "unchanged_bytes", "bytes not copied because they had not changed since their backup was "    \
      "written (skip_unchanged)")                                                                              \
    X(verified, "verified_bytes", "bytes a resume restored and found, by their fingerprints, as they were "   \
      "paused")                                                                                                \
    X(kept, "kept_bytes", "of released_bytes, those a pause kept for the other members of its job")           \
    X(returned, "returned_bytes", "borrowed bytes a pause gave back to the members of its job that lent them") \
    X(reused, "reused_bytes", "bytes a resume mapped from memory this process kept for its job")              \
    X(borrowed, "borrowed_bytes", "bytes a resume mapped from memory other members of its job lent")

/* One device's part of a pause or resume. */
struct tms_op_device {
    int device;
    size_t allocations;   /* paused (resumed) by the call */
#define TMS_REPORT_FIELD(field, name, doc) size_t field;
    TMS_REPORT_BYTES(TMS_REPORT_FIELD)
#undef TMS_REPORT_FIELD
    size_t free_before, free_after;  /* the driver's free bytes around the call (0 if it could not say) */
    int free_measured;    /* free_before and free_after were asked for (tms_op_args.measure_free) */
    /* Lending within a job: the first lenders of a resume with their bytes,
     * and why the driver served the rest. */
    int lenders;          /* members it borrowed from; the first TMS_REPORT_PIDS in lender_pids */
    int lender_pids[TMS_REPORT_PIDS];
    size_t lender_bytes[TMS_REPORT_PIDS];
    int fallback;         /* enum tms_job_fallback (resume) */
    int timed_out;        /* members that did not answer in time (pause or resume); the first listed */
    int timed_out_pids[TMS_REPORT_PIDS];
};

#define TMS_REPORT_UNCONFIRMED 64

/* An allocation a pause unmapped while a receiver may still map its memory:
 * the receiver hung up without saying it let go, and its process lived. Its
 * bytes are not in its device's `released`. */
struct tms_op_unconfirmed {
    uint64_t va;
    size_t reserved;      /* bytes unmapped here */
    int device;
    int receivers;        /* that hung up without letting go */
    int pids[TMS_REPORT_PIDS];  /* the first of them; 0 past `receivers` */
    const char *tag;      /* pooled: valid for the process's life */
};

struct tms_op_report {
    uint64_t ns;
    size_t n_devices;     /* devices beyond TMS_REPORT_DEVICES are left out */
    struct tms_op_device devices[TMS_REPORT_DEVICES];
    size_t n_unconfirmed; /* all of them; the first TMS_REPORT_UNCONFIRMED are listed */
    struct tms_op_unconfirmed unconfirmed[TMS_REPORT_UNCONFIRMED];
    uint64_t fingerprint_ns;  /* a pause's time spent fingerprinting (unchanged memory, and what it copied) */
    uint64_t verify_ns;       /* a resume's time spent checking what it restored */
    char why_not_skipped[160];  /* "" or why memory that was to skip unchanged chunks was copied whole */
    char why_not_verified[160]; /* "" or why some bytes backed up (pause) or restored (resume) are not checked */
    /* Allocations holding bytes that are not theirs: a failed resume left them
     * mapped and active so (the unmap that would have paused them again failed
     * too), or this pause kept their backups (the truth) instead of copying them. */
    size_t n_wrong;
    uint64_t wrong[TMS_REPORT_PIDS];
};

#endif
