"""What a TP 2 stage's collectives cost per all-reduce and per step broadcast (issue 13).

    .venv/bin/python bench/probe_tp.py [--rounds 9]

The cost model charges every collective of a TP group one ``collective_overhead_s`` (two all-reduces
per layer plus the step's three broadcasts). ``hetserve calibrate`` fits it from one TP 2 stage of
all the checkpoint's layers (16 all-reduces + 3 broadcasts on the tiny Llama); bench_predict's
asymmetric plan has a TP 2 stage of 2 layers (4 + 3). This probe serves the tiny Llama with 8 and 2
layers on TP 1 and TP 2 (engine only, no HTTP), in interleaved rounds, and splits what TP 2 adds
to a one-token decode into a cost per all-reduce and per broadcast (the layer counts differ, the
broadcasts do not). A 128-token prompt's difference also holds TP's halved compute.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.scratch import scratch_dir  # noqa: E402  (after the path: run as a script)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=9)
    args = ap.parse_args()

    import numpy as np

    from hetserve.runtime.engine import Engine, EngineConfig
    from hetserve.runtime.make_model import make_model
    from hetserve.runtime.probe_shapes import one_device_cluster, one_device_plan
    from hetserve.runtime.sampling import SamplingParams
    from hetserve.specs.model import load_model

    tmp, rng = scratch_dir("probe-tp-"), np.random.default_rng(0)
    engines = {}
    try:
        for layers in (8, 2):
            model_dir = make_model(tmp / f"tiny{layers}", "llama", layers=layers, hidden=256, heads=4, kv_heads=2,
                                   ffn=768)
            spec = load_model(model_dir)
            for tp in (1, 2):
                cluster = one_device_cluster("RTX-4090", tp)
                eng = Engine.from_plan(one_device_plan(spec, cluster, 1, tp), cluster, model_dir,
                                       EngineConfig(max_num_seqs=4))
                eng.generate([[65] * 8], SamplingParams(max_tokens=4, ignore_eos=True))  # warm-up
                engines[(layers, tp)] = eng

        def run(eng, prompt: int, tokens: int):
            h = eng.submit(rng.integers(32, 127, prompt).tolist(), SamplingParams(max_tokens=tokens, ignore_eos=True))
            h.result(timeout=120)
            return h

        times = {k: {"prompt": [], "decode": []} for k in engines}
        for _ in range(args.rounds):  # rounds over every probe: the load of a shared machine drifts
            for k, eng in engines.items():
                times[k]["prompt"].append(run(eng, 128, 1).ttft)
                times[k]["decode"].append(run(eng, 16, 24).tpot)
            print(f"round done, load {os.getloadavg()[0]:.2f}")
    finally:
        for eng in engines.values():
            eng.shutdown()
    ms = {k: {m: 1e3 * statistics.median(v) for m, v in d.items()} for k, d in times.items()}
    for (layers, tp), v in ms.items():
        print(f"{layers} layers, TP {tp}: 128-token prompt {v['prompt']:.2f} ms, decode {v['decode']:.2f} ms per token")
    for m in ("decode", "prompt"):
        d8 = ms[(8, 2)][m] - ms[(8, 1)][m]
        d2 = ms[(2, 2)][m] - ms[(2, 1)][m]
        ar = (d8 - d2) / 12  # 16 - 4 all-reduces; the 3 broadcasts cancel
        bc = (d2 - 4 * ar) / 3
        print(f"{m}: TP 2 adds {d8:.2f} ms (8 layers) and {d2:.2f} ms (2 layers): {ar:.2f} ms per all-reduce, "
              f"{bc:.2f} ms per broadcast; {d8 / 19:.2f} / {d2 / 7:.2f} ms per collective")
    return 0


if __name__ == "__main__":
    sys.exit(main())
