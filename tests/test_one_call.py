"""A pause or resume from Python is one call into the core: the tags checked, PyTorch's
free blocks asked for only if the pause backs something up, and the call made; the
driver's free memory is asked for only where the report is asked for or logged."""


def test_a_pause_or_resume_is_one_call_into_the_core(run_py, ok):
    out = ok(run_py("""
        import torch_memory_saver._observe as observe
        calls = []
        for name in ("pause", "resume", "check_tags", "selects_backup", "mem_get_info", "stats", "allocations"):
            real = getattr(core, name)
            def counted(*a, _real=real, _name=name):
                calls.append(_name)
                return _real(*a)
            setattr(core, name, counted)
        with tms.region("w", enable_cpu_backup=True):
            w = tms.malloc(2 * MiB)
        data = fill(w, 2 * MiB)
        calls.clear()
        r = tms.pause("w")
        assert calls == ["pause"], calls
        assert r.devices[0].free_before is None and r.devices[0].free_after is None, r.devices[0]
        calls.clear()
        back = tms.resume("w")
        assert calls == ["resume"], calls
        assert read(w, 2 * MiB) == data
        r = tms.pause("w", measure_free=True)
        assert r.devices[0].free_after - r.devices[0].free_before == r.released_bytes == 2 * MiB, r.devices[0]
        back = tms.resume("w", measure_free=True)
        assert back.devices[0].free_before - back.devices[0].free_after == 2 * MiB, back.devices[0]
        observe.logger.setLevel("INFO")   # a logged call measures: its line can say what was freed
        r = tms.pause("w")
        assert r.devices[0].free_before is not None, r.devices[0]
        tms.resume("w")
        print("done")
    """))
    assert out == "done\n"


def test_the_free_blocks_are_asked_for_only_if_the_pause_backs_something_up(run_py, ok):
    out = ok(run_py("""
        asked = []
        def spans():
            asked.append(1)
            return None
        with tms.region("plain"):
            p = tms.malloc(2 * MiB)
        with tms.region("backed", enable_cpu_backup=True):
            b = tms.malloc(2 * MiB)
        data = fill(b, 2 * MiB)
        core.pause("plain", spans)
        assert asked == [], "asked for free blocks of a pause that backs nothing up"
        core.pause("backed", spans)
        assert asked == [1], asked
        core.resume(["plain", "backed"])
        assert read(b, 2 * MiB) == data
        # What the callable returns is used: the whole allocation skipped as free.
        r = core.pause("backed", lambda: __import__("struct").pack("=QQ", b, 2 * MiB))
        assert r["devices"][0]["skipped_bytes"] == 2 * MiB and r["devices"][0]["copied_bytes"] == 0, r
        core.resume("backed")
        # A bad tag is refused before the callable is asked, and nothing moves.
        for bad in ("", ["backed", "backed"]):
            try:
                core.pause(bad, spans)
            except ValueError as e:
                print(type(e).__name__, str(e)[:40])
            else:
                raise AssertionError(f"pause({bad!r}) passed")
        assert asked == [1] and states() == [("backed", "active"), ("plain", "active")], (asked, states())
        # An exception from the callable leaves everything as it was.
        def broken():
            raise RuntimeError("no snapshot")
        try:
            core.pause("backed", broken)
        except RuntimeError as e:
            assert "no snapshot" in str(e)
        assert states() == [("backed", "active"), ("plain", "active")], states()
        print("done")
    """))
    assert out.endswith("done\n") and out.count("ValueError") == 2, out
