"""What a pause or resume did: the object pause() and resume() return."""


def gb_per_s(nbytes, seconds):
    """nbytes over seconds in GB/s (10**9 bytes), 0.0 where nothing moved."""
    return nbytes / seconds / 1e9 if nbytes and seconds > 0 else 0.0


import importlib
from typing import TYPE_CHECKING, Dict, List, Optional

# The byte counts of a report, declared once in C (src/core/core.h, TMS_REPORT_BYTES):
# (name, doc) pairs, each an attribute of DeviceReport and a sum over devices on Report.
BYTE_FIELDS = importlib.import_module("torch_memory_saver._tms_env").report_fields()


def _device_field(name, doc):
    return property(lambda self: self._row[name], doc=doc)


def _summed_field(name, doc):
    return property(lambda self: sum(d._row[name] for d in self.devices.values()), doc=doc + " (every device)")


class DeviceReport:
    """One device's part of a pause or resume. Bytes are exact counts from the
    core (BYTE_FIELDS: released_bytes, mapped_bytes, copied_bytes, ...);
    free_before/free_after are the driver's free memory around the call (0 where
    it could not say), measured only when the call was given measure_free=True or
    logged at INFO (else None). fingerprint_seconds, verify_seconds,
    why_not_skipped and why_not_verified are the call's.

    In a job (TorchMemorySaver.job), a pause's kept_bytes (of released_bytes)
    stay this process's for the other members to borrow, and returned_bytes
    went back to the members that lent them; a resume's reused_bytes are memory
    this process kept, borrowed_bytes memory members lent ({pid: bytes} in
    lenders), and fallback says why the driver made the rest: None (not asked:
    no job, what it kept was enough, or the members lent it all), "no member",
    "member timed out" (their pids in timed_out), "nothing to lend" or "bad lend" (a
    member lent memory that failed the checks: refused whole)."""

    if TYPE_CHECKING:  # made from BYTE_FIELDS below; a test checks these match it
        released_bytes: int
        mapped_bytes: int
        copied_bytes: int
        skipped_bytes: int
        unchanged_bytes: int
        verified_bytes: int
        kept_bytes: int
        returned_bytes: int
        reused_bytes: int
        borrowed_bytes: int

    __slots__ = ("_row", "_call", "device", "allocations", "seconds", "free_before", "free_after", "lenders",
                 "fallback", "timed_out")

    def __init__(self, row, call):
        self._row = row
        self._call = call
        self.device: int = row["device"]
        self.allocations: int = row["allocations"]
        self.seconds: float = call.seconds
        self.free_before: Optional[int] = row["free_before"]
        self.free_after: Optional[int] = row["free_after"]
        self.lenders: Dict[int, int] = row.get("lenders", {})
        self.fallback: Optional[str] = row.get("fallback")
        self.timed_out: List[int] = row.get("timed_out", [])

    @property
    def fingerprint_seconds(self) -> float:
        """The call's time spent fingerprinting (a pause: unchanged memory, and what it copied)."""
        return self._call.fingerprint_seconds

    @property
    def verify_seconds(self) -> float:
        """The call's time spent checking what it restored (a resume)."""
        return self._call.verify_seconds

    @property
    def why_not_skipped(self) -> Optional[str]:
        return self._call.why_not_skipped

    @property
    def why_not_verified(self) -> Optional[str]:
        return self._call.why_not_verified

    @property
    def gb_per_s(self) -> float:
        """Bytes copied per second, in GB/s (0.0 when nothing was copied)."""
        return gb_per_s(self.copied_bytes, self.seconds)

    def as_dict(self):
        out = {k: getattr(self, k) for k in self.__slots__ if not k.startswith("_")}
        out.update({name: self._row[name] for name, _ in BYTE_FIELDS})
        out["gb_per_s"] = self.gb_per_s
        return out

    def __repr__(self):
        return (f"DeviceReport(device={self.device}, allocations={self.allocations}, "
                f"released_bytes={self.released_bytes}, copied_bytes={self.copied_bytes}, "
                f"skipped_bytes={self.skipped_bytes}, unchanged_bytes={self.unchanged_bytes}, "
                f"verified_bytes={self.verified_bytes}, seconds={self.seconds:.6f}, "
                f"free_before={self.free_before}, free_after={self.free_after})")


class Report:
    """What one pause() or resume() did: `devices` maps each device it touched
    to a DeviceReport; the byte totals (BYTE_FIELDS) sum them, and `lenders` merges
    theirs. A call that found nothing to do has no devices and zero totals.
    `unconfirmed`: the allocations a pause unmapped that another process may still
    map (a receiver of share() hung up without saying it let go, and its process
    lived), as dicts of ptr, bytes, device, tag, receivers and pids (the first 64);
    their bytes are not in released_bytes. `wrong_bytes`: the pointers of
    allocations a failed resume left active holding bytes that are not theirs (the
    unmap that would have paused them again failed too): their next pause keeps
    their backup, and the resume after restores it. `why_not_verified`: why some
    bytes a pause backed up, or a resume restored, were not checked (None: all were)."""

    if TYPE_CHECKING:
        released_bytes: int
        mapped_bytes: int
        copied_bytes: int
        skipped_bytes: int
        unchanged_bytes: int
        verified_bytes: int
        kept_bytes: int
        returned_bytes: int
        reused_bytes: int
        borrowed_bytes: int

    __slots__ = ("op", "seconds", "devices", "unconfirmed", "fingerprint_seconds", "verify_seconds",
                 "why_not_skipped", "why_not_verified", "wrong_bytes")

    def __init__(self, op, raw):
        self.op: str = op
        self.seconds: float = raw["ns"] / 1e9
        self.fingerprint_seconds: float = raw.get("fingerprint_ns", 0) / 1e9
        self.verify_seconds: float = raw.get("verify_ns", 0) / 1e9
        self.why_not_skipped: Optional[str] = raw.get("why_not_skipped") or None
        self.why_not_verified: Optional[str] = raw.get("why_not_verified") or None
        self.wrong_bytes: List[int] = raw.get("wrong_bytes", [])
        self.devices: Dict[int, DeviceReport] = {row["device"]: DeviceReport(row, self) for row in raw["devices"]}
        self.unconfirmed: List[dict] = raw.get("unconfirmed", [])

    @property
    def allocations(self) -> int:
        return sum(d.allocations for d in self.devices.values())

    @property
    def lenders(self) -> Dict[int, int]:
        """{pid: bytes} the members of a job lent a resume, over every device."""
        out: Dict[int, int] = {}
        for d in self.devices.values():
            for pid, n in d.lenders.items():
                out[pid] = out.get(pid, 0) + n
        return out

    @property
    def gb_per_s(self) -> float:
        """Bytes copied per second over every device, in GB/s."""
        return gb_per_s(self.copied_bytes, self.seconds)

    def as_dict(self):
        out = {"op": self.op, "seconds": self.seconds}
        out.update({name: getattr(self, name) for name, _ in BYTE_FIELDS})
        out.update({"fingerprint_seconds": self.fingerprint_seconds, "verify_seconds": self.verify_seconds,
                    "why_not_skipped": self.why_not_skipped, "why_not_verified": self.why_not_verified,
                    "wrong_bytes": self.wrong_bytes, "lenders": self.lenders,
                    "devices": {d: r.as_dict() for d, r in self.devices.items()}, "unconfirmed": self.unconfirmed})
        return out

    def __repr__(self):
        return (f"Report(op={self.op!r}, seconds={self.seconds:.6f}, released_bytes={self.released_bytes}, "
                f"copied_bytes={self.copied_bytes}, skipped_bytes={self.skipped_bytes}, "
                f"verified_bytes={self.verified_bytes}, devices={dict(sorted(self.devices.items()))!r})")


for _name, _doc in BYTE_FIELDS:
    setattr(DeviceReport, _name, _device_field(_name, _doc))
    setattr(Report, _name, _summed_field(_name, _doc))
del _name, _doc


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
