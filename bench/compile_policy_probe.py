"""Probe which torch.compile policies survive two worker threads, one GPU each.

Run on a multi-GPU machine: `python bench/compile_policy_probe.py [--out DIR]`.
Each variant runs in its own subprocess with a timeout, so a crash or a hang is
recorded as a finding instead of ending the probe. Also records facts about the
installed torch (thread-local trees, per-thread inductor config) and times the
in-process NCCL all-reduce that the threaded trainer uses for gradients.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
import traceback

VARIANTS = [
    "eager",
    "default",
    "ro",  # mode="reduce-overhead", trees left on (the seed's crash)
    "cg_options",  # options={"triton.cudagraphs": True, "triton.cudagraph_trees": False}
    "ro_global_main",  # inductor config set in the main thread before workers start
    "ro_global_thread",  # inductor config set inside each worker thread
    "cg_options_nolock",  # as cg_options, warm-up not serialised by our lock
]
STEPS = 20


def torch_facts() -> dict:
    """Version facts that decide the compile policy."""
    import torch
    import torch._inductor.config as icfg
    import torch._inductor.cudagraph_trees as cgt

    seen: list = []
    icfg.triton.cudagraph_trees = False
    t = threading.Thread(target=lambda: seen.append(icfg.triton.cudagraph_trees))
    t.start()
    t.join()
    icfg.triton.cudagraph_trees = True
    return {
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "gpus": torch.cuda.device_count(),
        "trees_has__initialize_tls": hasattr(cgt, "_initialize_tls"),
        "trees_has_graph_capture_lock": hasattr(cgt, "graph_capture_lock"),
        "config_set_in_main_seen_by_thread": seen[0] is False,
        "nccl_available": bool(torch.cuda.nccl.is_available([torch.zeros(1, device="cuda")])),
        "nccl_version": torch.cuda.nccl.version(),
    }


def dump_source(path: str) -> None:
    """Write the torch source lines that the docs cite (line numbers of this install)."""
    import inspect
    import torch._dynamo.convert_frame as cf
    import torch._inductor.compile_fx as cfx
    import torch._inductor.cudagraph_trees as cgt
    import torch.utils._config_module as cm

    keys = (
        "_is_key_in_tls",
        "_stash_obj_in_tls",
        "_initialize_tls",
        "graph_capture_lock",
        "threading.local",
        "def get_obj",
        "def get_container",
        "local = ",
        "cudagraph_trees",
        "def cudagraphify",
        "capture_error_mode",
        "synchronize()",
        "compile_lock",
        "ContextVar",
        "thread",
    )
    with open(path, "w") as f:
        for mod in (cgt, cfx, cf, cm):
            f.write(f"==== {mod.__file__}\n")
            for n, line in enumerate(inspect.getsource(mod).splitlines(), 1):
                if any(k in line for k in keys):
                    f.write(f"{n}: {line}\n")
        f.write("==== cgt head (1-60 of get_obj/get_container region)\n")
        src = inspect.getsource(cgt).splitlines()
        start = next(i for i, ln in enumerate(src) if "def get_obj" in ln)
        f.write("\n".join(f"{start - 40 + i + 1}: {ln}" for i, ln in enumerate(src[start - 40 : start + 30])))
        src = inspect.getsource(cfx).splitlines()
        start = next(i for i, ln in enumerate(src) if ln.startswith("def cudagraphify("))
        f.write("\n==== compile_fx cudagraphify\n")
        f.write("\n".join(f"{start + i + 1}: {ln}" for i, ln in enumerate(src[start : start + 130])))


def make_model(torch, d: int = 512, layers: int = 2):
    """A small transformer stack, enough to exercise fwd+bwd graphs."""
    nn = torch.nn

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
            self.attn = nn.MultiheadAttention(d, d // 64, batch_first=True)
            self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

        def forward(self, x):
            y = self.ln1(x)
            x = x + self.attn(y, y, y, need_weights=False)[0]
            return x + self.mlp(self.ln2(x))

    return nn.Sequential(*[Block() for _ in range(layers)])


def checksum(torch, model) -> int:
    """Exact integer sum of parameter bit patterns: equal iff replicas are (almost surely) equal."""
    return int(sum(p.detach().view(torch.int16).to(torch.int64).sum().item() for p in model.parameters()))


def run_variant(name: str) -> None:
    """Train one model per GPU in one thread per GPU and print a JSON result line."""
    import torch

    ngpu = min(2, torch.cuda.device_count())
    lock = threading.Lock()
    barrier = threading.Barrier(ngpu)
    results: dict = {}
    if name == "ro_global_main":
        torch._inductor.config.triton.cudagraph_trees = False

    def compiled(model):
        if name == "eager":
            return model
        if name == "default":
            return torch.compile(model)
        if name.startswith("cg_options"):
            return torch.compile(model, options={"triton.cudagraphs": True, "triton.cudagraph_trees": False})
        if name == "ro_global_thread":
            torch._inductor.config.triton.cudagraph_trees = False
        return torch.compile(model, mode="reduce-overhead")

    def worker(i: int) -> None:
        try:
            dev = torch.device("cuda", i)
            torch.cuda.set_device(dev)
            with lock:
                torch.manual_seed(1234)
                model = make_model(torch).to(dev, torch.bfloat16)
                x = torch.randn(8, 256, 512, generator=torch.Generator().manual_seed(7)).to(dev, torch.bfloat16)
            opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
            fn = compiled(model)

            def step():
                loss = fn(x).float().pow(2).mean()
                loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
                return loss.detach()

            t0 = time.time()
            if name.endswith("nolock"):
                for _ in range(3):
                    step()
            else:
                with lock:
                    for _ in range(3):
                        step()
            torch.cuda.synchronize(dev)
            warm = time.time() - t0
            barrier.wait(timeout=300)
            t0 = time.time()
            for _ in range(STEPS):
                loss = step()
            torch.cuda.synchronize(dev)
            ms = (time.time() - t0) / STEPS * 1e3
            results[i] = {
                "ok": True,
                "warm_s": round(warm, 1),
                "ms": round(ms, 2),
                "loss": float(loss),
                "checksum": checksum(torch, model),
            }
        except BaseException as e:  # a finding, recorded for the table
            barrier.abort()
            tb = traceback.format_exc().splitlines()
            results[i] = {
                "ok": False,
                "error": f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}",
                "where": [ln for ln in tb if ln.strip().startswith("File")][-2:],
            }

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(ngpu)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    print("RESULT " + json.dumps({"variant": name, "torch": torch.__version__, "workers": results}), flush=True)


def run_nccl() -> None:
    """Time torch.cuda.nccl.all_reduce over one flat buffer per GPU, called from a barrier action."""
    import torch

    out = {}
    for numel in (16 << 20, 150 << 20):
        for dtype in (torch.bfloat16, torch.float32):
            bufs = [torch.full((numel,), float(i + 1), device=f"cuda:{i}", dtype=dtype) for i in range(2)]
            for _ in range(3):
                torch.cuda.nccl.all_reduce(bufs)
            for i in range(2):
                torch.cuda.synchronize(i)
            for b in bufs:
                b.fill_(1.0)
            t0 = time.time()
            reps = 10
            for _ in range(reps):
                torch.cuda.nccl.all_reduce(bufs)
            for i in range(2):
                torch.cuda.synchronize(i)
            ms = (time.time() - t0) / reps * 1e3
            ok = all(float(b[0]) == 2.0**reps for b in bufs)  # sum of two equal buffers doubles them
            same = bool(torch.equal(bufs[0].cpu(), bufs[1].cpu()))
            nbytes = numel * bufs[0].element_size()
            out[f"{numel >> 20}M_{str(dtype)[6:]}"] = {
                "ms": round(ms, 3),
                "algbw_GBs": round(nbytes / ms / 1e6, 1),
                "equal_across_gpus": same,
                "ok": ok,
            }
    # threads: each worker fills its buffer, the barrier action (one thread) reduces for all
    bufs = [torch.randn(1 << 20, device=f"cuda:{i}", generator=None) for i in range(2)]
    expect = bufs[0].cpu().double() + bufs[1].cpu().double()
    barrier = threading.Barrier(2, action=lambda: torch.cuda.nccl.all_reduce(bufs))
    errs = []

    def w(i):
        try:
            torch.cuda.set_device(i)
            bufs[i].mul_(1.0)
            barrier.wait(timeout=60)
            torch.cuda.synchronize(i)
        except BaseException as e:
            errs.append(repr(e))

    ts = [threading.Thread(target=w, args=(i,)) for i in range(2)]
    [t.start() for t in ts]
    [t.join() for t in ts]
    err = float((bufs[1].cpu().double() - expect).abs().max())
    out["from_barrier_action"] = {
        "errors": errs,
        "max_abs_err": err,
        "equal_across_gpus": bool(torch.equal(bufs[0].cpu(), bufs[1].cpu())),
    }
    print("RESULT " + json.dumps({"variant": "nccl", "nccl": out}), flush=True)


def main() -> None:
    """Run every variant in its own subprocess and print a table."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--timeout", type=int, default=240)
    ap.add_argument("--variant")
    args = ap.parse_args()
    if args.variant:
        return run_nccl() if args.variant == "nccl" else run_variant(args.variant)
    facts = torch_facts()
    print("FACTS " + json.dumps(facts), flush=True)
    dump_source(os.path.join(args.out, f"torch_src_{facts['torch'].split('+')[0]}.txt"))
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    procs = {}
    for v in VARIANTS + ["nccl"]:  # in parallel: timings are indicative only, outcomes are the point
        log = open(os.path.join(args.out, f"probe_{v}.log"), "w")  # merged into one file below
        procs[v] = (
            subprocess.Popen([sys.executable, __file__, "--variant", v], stdout=log, stderr=subprocess.STDOUT, env=env),
            log,
        )
    deadline = time.time() + args.timeout
    rows = []
    for v, (p, log) in procs.items():
        try:
            rc = p.wait(timeout=max(1, deadline - time.time()))
        except subprocess.TimeoutExpired:
            p.kill()
            rc = "HANG(killed)"
        log.close()
        text = open(log.name).read()
        res = [ln[7:] for ln in text.splitlines() if ln.startswith("RESULT ")]
        rows.append(
            {
                "variant": v,
                "rc": rc,
                "result": json.loads(res[-1]) if res else None,
                "tail": text.splitlines()[-3:] if not res else [],
            }
        )
    with open(os.path.join(args.out, "probe_results.json"), "w") as f:
        json.dump({"facts": facts, "rows": rows}, f, indent=1)
    with open(os.path.join(args.out, "probe_logs.txt"), "w") as f:  # one file: few files come back
        for v, (_, log) in procs.items():
            f.write(f"######## {v}\n" + open(log.name).read())
            os.remove(log.name)
    print(f"\n{'variant':<20} {'rc':<14} outcome")
    for r in rows:
        res = r["result"]
        if res and "workers" in res:
            w = res["workers"]
            cell = " | ".join(
                (
                    f"ok {x['ms']}ms warm {x['warm_s']}s loss {x['loss']:.5f} ck {x['checksum']}"
                    if x["ok"]
                    else f"FAIL {x['error'][:90]}"
                )
                for _, x in sorted(w.items())
            )
        elif res:
            cell = json.dumps(res["nccl"])
        else:
            cell = " / ".join(r["tail"])[:200]
        print(f"{r['variant']:<20} {str(r['rc']):<14} {cell}")


if __name__ == "__main__":
    main()
