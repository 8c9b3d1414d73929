"""What a pause or resume did: the object pause() and resume() return."""


def gb_per_s(nbytes, seconds):
    """nbytes over seconds in GB/s (10**9 bytes), 0.0 where nothing moved."""
    return nbytes / seconds / 1e9 if nbytes and seconds > 0 else 0.0


class DeviceReport:
    """One device's part of a pause or resume. Bytes are exact counts from the
    core; free_before/free_after are the driver's free memory around the call
    (0 where it could not say), measured only when the call was given
    measure_free=True or logged at INFO (else None).

    In a job (TorchMemorySaver.job), a pause's kept_bytes (of released_bytes)
    stay this process's for the other members to borrow, and returned_bytes
    went back to the members that lent them; a resume's reused_bytes are memory
    this process kept, borrowed_bytes memory members lent ({pid: bytes} in
    lenders), and fallback says why the driver made the rest: None (not asked:
    no job, or what it kept was enough), "none" (nothing from the driver), "no
    member", "member timed out" (their pids in timed_out), "nothing to lend" or
    "bad lend" (a member lent memory that failed the checks: refused whole)."""

    __slots__ = ("device", "allocations", "released_bytes", "copied_bytes", "skipped_bytes", "unchanged_bytes",
                 "seconds", "free_before", "free_after", "kept_bytes", "returned_bytes", "reused_bytes",
                 "borrowed_bytes", "lenders", "fallback", "timed_out")

    def __init__(self, row, seconds):
        self.device = row["device"]
        self.allocations = row["allocations"]
        self.released_bytes = row["released"]
        self.copied_bytes = row["copied"]
        self.skipped_bytes = row["skipped"]
        self.unchanged_bytes = row.get("unchanged", 0)
        self.seconds = seconds
        self.free_before = row["free_before"]
        self.free_after = row["free_after"]
        self.kept_bytes = row.get("kept", 0)
        self.returned_bytes = row.get("returned", 0)
        self.reused_bytes = row.get("reused", 0)
        self.borrowed_bytes = row.get("borrowed", 0)
        self.lenders = row.get("lenders", {})
        self.fallback = row.get("fallback")
        self.timed_out = row.get("timed_out", [])

    @property
    def gb_per_s(self):
        """Bytes copied per second, in GB/s (0.0 when nothing was copied)."""
        return gb_per_s(self.copied_bytes, self.seconds)

    def as_dict(self):
        out = {k: getattr(self, k) for k in self.__slots__}
        out["gb_per_s"] = self.gb_per_s
        return out

    def __repr__(self):
        return (f"DeviceReport(device={self.device}, allocations={self.allocations}, "
                f"released_bytes={self.released_bytes}, copied_bytes={self.copied_bytes}, "
                f"skipped_bytes={self.skipped_bytes}, unchanged_bytes={self.unchanged_bytes}, seconds={self.seconds:.6f}, "
                f"free_before={self.free_before}, free_after={self.free_after})")


class Report:
    """What one pause() or resume() did: `devices` maps each device it touched
    to a DeviceReport; the totals sum them. A call that found nothing to do has
    no devices and zero totals. `unconfirmed`: the allocations a pause unmapped
    that another process may still map (a receiver of share() hung up without
    saying it let go, and its process lived), as dicts of ptr, bytes, device,
    tag, receivers and pids (the first 64); their bytes are not in released_bytes."""

    __slots__ = ("op", "seconds", "devices", "unconfirmed", "fingerprint_seconds", "why_not_skipped")

    def __init__(self, op, raw):
        self.op = op
        self.seconds = raw["ns"] / 1e9
        self.fingerprint_seconds = raw.get("fingerprint_ns", 0) / 1e9
        self.why_not_skipped = raw.get("why_not_skipped") or None
        self.devices = {row["device"]: DeviceReport(row, self.seconds) for row in raw["devices"]}
        self.unconfirmed = raw.get("unconfirmed", [])

    def _sum(self, field):
        return sum(getattr(d, field) for d in self.devices.values())

    @property
    def allocations(self):
        return self._sum("allocations")

    @property
    def released_bytes(self):
        """Bytes of device memory unmapped (pause) or mapped (resume)."""
        return self._sum("released_bytes")

    @property
    def copied_bytes(self):
        """Bytes copied to (pause) or from (resume) backups."""
        return self._sum("copied_bytes")

    @property
    def skipped_bytes(self):
        """Bytes of backed-up allocations not copied: free blocks of PyTorch's cache."""
        return self._sum("skipped_bytes")

    @property
    def unchanged_bytes(self):
        """Bytes of backed-up allocations not copied because they had not changed
        since their backup was written (skip_unchanged)."""
        return self._sum("unchanged_bytes")

    @property
    def kept_bytes(self):
        """Of released_bytes, those a pause kept for the other members of its job."""
        return self._sum("kept_bytes")

    @property
    def borrowed_bytes(self):
        """Bytes a resume mapped from memory other members of its job lent."""
        return self._sum("borrowed_bytes")

    @property
    def gb_per_s(self):
        """Bytes copied per second over every device, in GB/s."""
        return gb_per_s(self.copied_bytes, self.seconds)

    def as_dict(self):
        return {"op": self.op, "seconds": self.seconds, "released_bytes": self.released_bytes,
                "copied_bytes": self.copied_bytes, "skipped_bytes": self.skipped_bytes,
                "unchanged_bytes": self.unchanged_bytes, "fingerprint_seconds": self.fingerprint_seconds,
                "why_not_skipped": self.why_not_skipped, "kept_bytes": self.kept_bytes,
                "borrowed_bytes": self.borrowed_bytes,
                "devices": {d: r.as_dict() for d, r in self.devices.items()}, "unconfirmed": self.unconfirmed}

    def __repr__(self):
        return (f"Report(op={self.op!r}, seconds={self.seconds:.6f}, released_bytes={self.released_bytes}, "
                f"copied_bytes={self.copied_bytes}, skipped_bytes={self.skipped_bytes}, "
                f"devices={dict(sorted(self.devices.items()))!r})")


def memory_report(core, use_torch, devices=()):
    """{device: {...}}: the device's memory as the driver counts it (total,
    free, used), and who holds the used part: this library's active
    allocations (ours_active), PyTorch's caching allocator outside them
    (torch_outside, of which torch_outside_free is cached free blocks), and the
    rest (other: CUDA context, NCCL, cuBLAS workspaces, other processes).
    ours_paused is reserved address space whose memory is released;
    host_retained, the host memory of backups kept while their allocations are
    active (retain_cpu_backup, skip_unchanged). In a job: job_kept is memory
    this process keeps idle for the other members, job_lent what they map of it
    now, job_borrowed the part of ours_active they lent. Every device holding an
    allocation or a PyTorch segment, and devices."""
    out = {}

    def device(d):
        if d not in out:
            free, total = core.mem_get_info(d)
            kept, lent, borrowed = core.job_memory(d)
            out[d] = {"total": total, "free": free, "used": total - free, "ours_active": 0, "ours_paused": 0,
                      "torch_outside": 0, "torch_outside_free": 0, "other": 0, "host_retained": 0,
                      "job_kept": kept, "job_lent": lent, "job_borrowed": borrowed}
        return out[d]

    for d in devices:
        device(d)
    for row in core.allocations():
        d = device(row["device"])
        d["ours_paused" if row["state"] in ("paused", "resuming") else "ours_active"] += row["reserved"]
        if row["state"] in ("active", "pausing") and row["has_cpu_backup"]:
            d["host_retained"] += row["backup_bytes"]  # a host copy kept while active: retained
    if use_torch:
        import torch

        if torch.cuda.is_initialized():
            for seg in torch.cuda.memory_snapshot():
                if core.allocation_at(seg["address"]) is not None:
                    continue  # ours: counted above
                d = device(seg["device"])
                d["torch_outside"] += seg["total_size"]
                d["torch_outside_free"] += sum(b["size"] for b in seg["blocks"] if b["state"] == "inactive")
    for d in out.values():
        # Kept and lent memory is this process's own: not another's.
        d["other"] = max(0, d["used"] - d["ours_active"] - d["torch_outside"] - d["job_kept"] - d["job_lent"])
    return out


def format_memory_report(report):
    GiB = float(1 << 30)
    cols = ("total", "used", "ours_active", "ours_paused", "torch_outside", "torch_outside_free", "other", "host_retained")
    lines = ["device " + " ".join(f"{c:>18}" for c in cols)]
    for dev in sorted(report):
        lines.append(f"{dev:>6} " + " ".join(f"{report[dev][c] / GiB:>14.3f} GiB" for c in cols))
    return "\n".join(lines)
