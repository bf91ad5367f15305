"""Bad-input cases of each command: plan files, options that conflict or cannot act under the others,
and the files each command reads besides the specs."""

from __future__ import annotations

import json

from .bad_input_runner import BINARY, CLUSTER, HEADER, PD_PLAN, PLAN, SIM, Case, plan_with, stage

C = Case
SHA = "0" * 64
# a plan made on the case's c.yaml (its digest is not c.yaml's: the file "changed since")
ON_FILE = {"model": "llama-2-7b", "cluster": "c", "cluster_file": {"path": "c.yaml", "sha256": SHA},
           "replicas": [stage(["a:0"], [0, 32])]}
BURST = HEADER + "0,100,20\n" * 5
# a colocated replica of two stages: what --pipeline detailed simulates stage by stage
PP_PLAN = plan_with(replicas=[{"id": "c0", "role": "colocated", "stages": [
    {"devices": ["h100-0:0"], "layers": [0, 16]}, {"devices": ["h100-0:1"], "layers": [16, 32]}]}])
LONG = HEADER + "0,5000,20\n1,6000,20\n"  # every request beyond llama-2-7b's 4096 tokens
UNSORTED = HEADER + "0,100,20\n-3,100,20\n1.0,100,20\n"  # line 3 comes before line 2
SERVE = "serve --plan {d}/tiny.json --model {d}/m --port 0"
CAP = "capacity --gpu A100-SXM-80G --model llama-2-7b --workload {d}/t.csv --slo-ttft 1 --slo-tpot 0.1"
PLAN_CMD = "plan --cluster {d}/c.yaml --model llama-2-7b --workload {d}/t.csv"
CMP = "compare --plan {d}/plan.json --model {d}/m --workload {d}/t.csv"
EXPORT = "export --plan {d}/plan.json --to vllm -o {d}/out"
CAL = "calibrate --model {d}/m"
LAYER = "cost layer --gpu H200 --model llama-2-7b"
ROUTE = "route --backends http://127.0.0.1:9 --port 0"


def route_deploy(*replicas: tuple[str, str]) -> str:
    """A deploy.json (``hetserve export``) with these (id, role) replicas on loopback endpoints."""
    return json.dumps({"replicas": [{"id": i, "role": role, "endpoint": f"http://127.0.0.1:{9000 + k}"}
                                    for k, (i, role) in enumerate(replicas)]})

PLAN_FILE_CASES = [
    C("plan-missing", "simulate --plan {d}/nope.json --workload {d}/t.csv", ("{d}/nope.json", "plan file")),
    C("plan-dir", "describe plan {d}/dir", ("{d}/dir",)),
    C("plan-empty", "describe plan {d}/x.json", ("x.json",), {"x.json": ""}),
    C("plan-binary", "describe plan {d}/x.json", ("x.json", "UTF-8"), {"x.json": BINARY}),
    C("plan-is-csv", "describe plan {d}/x.csv", ("x.csv", "mapping"), {"x.csv": "a,b\n1,2\n"}),
    C("plan-yaml-named-json", "describe plan {d}/x.json", ("x.json", "JSON"),
      {"x.json": "model: llama-2-7b\ncluster: hexgen2-homo\n"}),
    C("plan-top-list", "describe plan {d}/x.json", ("x.json", "mapping"), {"x.json": "[]"}),
    C("plan-no-replicas", "describe plan {d}/x.json", ("x.json", "replicas"),
      {"x.json": json.dumps({"model": "llama-2-7b", "cluster": "hexgen2-homo"})}),
    C("plan-replicas-empty", "describe plan {d}/x.json", ("x.json", "replicas"), {"x.json": plan_with(replicas=[])}),
    C("plan-role-unknown", "describe plan {d}/x.json", ("x.json", "role", "both"),
      {"x.json": plan_with(replicas=[stage(["h100-0:0"], [0, 32], role="both")])}),
    C("plan-devices-empty", "describe plan {d}/x.json", ("x.json", "devices"),
      {"x.json": plan_with(replicas=[stage([], [0, 32])])}),
    C("plan-layers-strings", "describe plan {d}/x.json", ("x.json", "layers"),
      {"x.json": plan_with(replicas=[stage(["h100-0:0"], ["a", "b"])])}),
    C("plan-misspelt-field", "describe plan {d}/x.json", ("x.json", "replica", "spelling"),
      {"x.json": json.dumps({"model": "llama-2-7b", "cluster": "hexgen2-homo", "replica": PLAN["replicas"]})}),
    C("plan-key-twice", "describe plan {d}/x.json", ("x.json", "model", "twice"),
      {"x.json": json.dumps(PLAN)[:-1] + ', "model": "llama-2-13b"}'}),
    C("plan-sha-malformed", "describe plan {d}/x.json", ("x.json", "cluster_file.sha256"),
      {"x.json": json.dumps({**ON_FILE, "cluster_file": {"path": "c.yaml", "sha256": "xyz"}})}),
    C("plan-device-unknown-machine", SIM.replace("plan.json", "x.json"), ("x.json", "zz:0"),
      {"x.json": plan_with(replicas=[stage(["zz:0"], [0, 32])])}),
    C("plan-device-index-out-of-range", SIM.replace("plan.json", "x.json"), ("h100-0:99",),
      {"x.json": plan_with(replicas=[stage(["h100-0:99"], [0, 32])])}),
    C("plan-device-malformed", SIM.replace("plan.json", "x.json"), ("h100-0",),
      {"x.json": plan_with(replicas=[stage(["h100-0"], [0, 32])])}),
    C("plan-layers-reversed", SIM.replace("plan.json", "x.json"), ("c0", "layers"),
      {"x.json": plan_with(replicas=[stage(["h100-0:0"], [32, 0])])}),
    C("plan-layers-negative", "describe plan {d}/x.json", ("x.json", "c0", "layers", "-1"),
      {"x.json": plan_with(replicas=[stage(["h100-0:0"], [-1, 32])])}),
    C("plan-layers-negative-export", EXPORT.replace("plan.json", "x.json"), ("x.json", "c0", "layers"),
      {"x.json": plan_with(replicas=[stage(["h100-0:0"], [-1, 32])])}),
    C("plan-estimate-not-a-number", "describe plan {d}/x.json", ("x.json", "estimate.throughput_tokens_per_s"),
      {"x.json": plan_with(estimate={"throughput_tokens_per_s": "fast"})}),
    C("plan-estimate-negative", "describe plan {d}/x.json", ("x.json", "estimate.cost_usd_per_hour", "0"),
      {"x.json": plan_with(estimate={"cost_usd_per_hour": -5})}),
    C("plan-layers-beyond-model", SIM.replace("plan.json", "x.json"), ("c0", "32"),
      {"x.json": plan_with(replicas=[stage(["h100-0:0"], [0, 40])])}),
    C("plan-layers-gap", SIM.replace("plan.json", "x.json"), ("c0", "layers"),
      {"x.json": plan_with(replicas=[{"id": "c0", "role": "colocated", "stages": [
          {"devices": ["h100-0:0"], "layers": [0, 10]}, {"devices": ["h100-0:1"], "layers": [12, 32]}]}])}),
    C("plan-device-twice", SIM.replace("plan.json", "x.json"), ("h100-0:0",),
      {"x.json": plan_with(replicas=[stage(["h100-0:0"], [0, 32]), stage(["h100-0:0"], [0, 32], rid="c1")])}),
    C("plan-replica-id-twice", SIM.replace("plan.json", "x.json"), ("c0",),
      {"x.json": plan_with(replicas=[stage(["h100-0:0"], [0, 32]), stage(["h100-0:1"], [0, 32])])}),
    C("plan-route-unknown-replica", SIM.replace("plan.json", "x.json"), ("x.json", "zz"),
      {"x.json": json.dumps({**PD_PLAN, "kv_routes": [{"from": "p0", "to": "zz", "weight": 1}]})}),
    C("plan-route-weight-negative", SIM.replace("plan.json", "x.json"), ("x.json", "weight"),
      {"x.json": json.dumps({**PD_PLAN, "kv_routes": [{"from": "p0", "to": "d0", "weight": -1}]})}),
    C("plan-route-weight-nan", SIM.replace("plan.json", "x.json"), ("x.json", "weight"),
      {"x.json": json.dumps({**PD_PLAN, "kv_routes": [{"from": "p0", "to": "d0", "weight": float("nan")}]})}),
    C("plan-route-weight-inf", SIM.replace("plan.json", "x.json"), ("x.json", "weight"),
      {"x.json": json.dumps({**PD_PLAN, "kv_routes": [{"from": "p0", "to": "d0", "weight": float("inf")}]})}),
    C("plan-prefill-without-route", SIM.replace("plan.json", "x.json"), ("p0",),
      {"x.json": json.dumps({**PD_PLAN, "kv_routes": []})}),
    C("plan-cluster-file-missing", SIM.replace("plan.json", "x.json"), ("x.json", "cluster_file.path", "--cluster"),
      {"x.json": json.dumps({**ON_FILE, "cluster_file": {"path": "gone.yaml", "sha256": SHA}})}),
    C("plan-cluster-not-preset", SIM.replace("plan.json", "x.json"), ("x.json", "mypool", "--cluster"),
      {"x.json": plan_with(cluster="mypool")}),
    C("plan-model-not-preset", SIM.replace("plan.json", "x.json"), ("x.json", "llama-9b", "--model"),
      {"x.json": plan_with(model="llama-9b")}),
    C("plan-cluster-file-changed", SIM.replace("plan.json", "x.json") + " --limit 3", files={"x.json": json.dumps(ON_FILE)},
      accepted="the plan runs on its cluster file as the file is now, checked against it, and a warning names "
               "the file that changed"),
    C("plan-cluster-file-changed-device-gone", SIM.replace("plan.json", "x.json"), ("b:0",),
      {"x.json": json.dumps({**ON_FILE, "replicas": [stage(["b:0"], [0, 32])]}),
       "c.yaml": CLUSTER.replace("  - {name: b, gpu: L4, count: 2, site: s1}\n", "")}),
    C("describe-plan-cluster-missing", "describe plan {d}/plan.json --cluster {d}/nope.yaml", ("{d}/nope.yaml",)),
    C("describe-plan-no-file", "describe plan", ("plan file",)),
]

SIMULATE_CASES = [
    C("sim-workload-missing", SIM.replace("{d}/t.csv", "{d}/nope.csv"), ("{d}/nope.csv",)),
    C("sim-workload-dir", SIM.replace("{d}/t.csv", "{d}/dir"), ("{d}/dir",)),
    C("sim-workload-is-plan", SIM.replace("{d}/t.csv", "{d}/plan.json"), ("plan.json", "header")),
    C("sim-efficiency-missing", SIM + " --efficiency {d}/nope.json", ("nope.json",)),
    C("sim-efficiency-dir", SIM + " --efficiency {d}/dir", ("{d}/dir",)),
    C("sim-efficiency-list", SIM + " --efficiency {d}/e.json", ("e.json",), {"e.json": "[0.5]"}),
    C("sim-efficiency-misspelt", SIM + " --efficiency {d}/e.json", ("e.json", "computee"),
      {"e.json": json.dumps({"computee": 0.5})}),
    C("sim-efficiency-binary", SIM + " --efficiency {d}/e.json", ("e.json",), {"e.json": BINARY}),
    C("sim-sweep-letters", SIM + " --sweep-rates a,b", ("--sweep-rates",)),
    C("sim-sweep-commas", SIM + " --sweep-rates ,", ("--sweep-rates",)),
    C("sim-sweep-empty-entry", SIM + " --sweep-rates 2,,5", ("--sweep-rates", "2,,5")),
    C("sim-sweep-nothing", SIM + " --sweep-rates ''", ("--sweep-rates", "''")),
    C("sim-sweep-nan", SIM + " --sweep-rates 1,nan", ("--sweep-rates", "nan")),
    C("sim-sweep-inf", SIM + " --sweep-rates 1,inf", ("--sweep-rates", "inf")),
    C("sim-class-leaves-none", SIM + " --workload-class HPHD", ("t.csv", "HPHD")),
    C("sim-model-other-layers", SIM + " --model llama-2-13b", ("c0", "40")),
    C("sim-cluster-lacks-devices", SIM + " --cluster {d}/c.yaml", ("h100-0:0",)),
    C("sim-gamma-without-aladdin", SIM + " --gamma 0.3", ("--gamma", "aladdin")),
    C("sim-rate-and-rate-scale", SIM + " --rate 2 --rate-scale 2", ("--rate-scale", "not allowed")),
    C("sim-within-and-beyond", SIM + " --within-context --run-beyond-context", ("--run-beyond-context",)),
    C("sim-rate-on-burst", SIM.replace("t.csv", "b.csv") + " --rate 5", ("b.csv", "one instant", "--rate"),
      {"b.csv": BURST}),
    C("sim-transmission-no-links", SIM + " --transmission serial", ("--transmission serial",)),
    C("sim-route-on-colocated", SIM + " --route load", ("--route",)),
    C("sim-chunked-on-disagg", SIM.replace("plan.json", "pd.json") + " --chunked-prefill", ("--chunked-prefill",)),
    C("sim-prefill-first-on-disagg", SIM.replace("plan.json", "pd.json") + " --prefill-mode prefill_first",
      ("--prefill-mode",)),
    # the runtime's rule (serve --max-batched-tokens): a budget below the batch cap is refused, not ignored
    C("sim-token-budget-below-batch", SIM + " --token-budget 1",
      ("--token-budget", "got 1", "batch cap (--max-batch) (256)", "--prefill-mode chunked --chunk-tokens")),
    C("sim-token-budget-below-given-batch", SIM + " --token-budget 8 --max-batch 16",
      ("--token-budget", "got 8", "at least --max-batch (16)")),
    C("sim-predictor-unused", SIM + " --predictor bucket --placement rr", ("--predictor", "rr")),
    C("sim-placement-twice", SIM + " --placement rr --router jsq", ("--router", "one placement", "--placement rr")),
    C("sim-pipeline-detailed-no-pipeline", SIM + " --pipeline detailed",
      ("--pipeline detailed", "plan.json", "drop --pipeline")),
    # what the stage-by-stage pipeline does not model is refused naming the options (and the trace)
    C("sim-pipeline-detailed-paged", SIM.replace("plan.json", "pp.json") + " --pipeline detailed --kv-admission paged",
      ("--kv-admission", "--pipeline aggregate", "paged with --pipeline detailed"), {"pp.json": PP_PLAN}),
    C("sim-pipeline-detailed-choices", SIM.replace("plan.json", "pp.json").replace("t.csv", "n.csv")
      + " --pipeline detailed", ("n.csv", "--pipeline detailed", "n > 1", "scoring their prompt"),
      {"pp.json": PP_PLAN, "n.csv": "TIMESTAMP,ContextTokens,GeneratedTokens,n,prompt_logprobs\n0,100,20,4,0\n"
                                    "1,100,20,1,1\n"}),
    C("serve-placement-twice", SERVE + " --placement rr --router jsq", ("--router", "one placement")),
    C("sim-all-beyond-context", SIM.replace("t.csv", "l.csv") + " --within-context", ("l.csv", "at least one"),
      {"l.csv": LONG}),
    C("sim-huge-prompt", SIM.replace("t.csv", "h.csv") + " --json", files={"h.csv": HEADER + "0,1000000000000,10\n1,10,10\n"},
      accepted="a request beyond the model's context is rejected at arrival and counted as rejected, as the "
               "server rejects it; a warning says how many and how to drop or run them"),
    C("sim-output-under-file", SIM + " -o {d}/t.csv/out", ("--output", "t.csv")),
    C("sim-trace-out-of-order", SIM.replace("t.csv", "u.csv"),
      ("u.csv:3", "'TIMESTAMP'", "non-decreasing order", "line 2's 0", "'-3'"), {"u.csv": UNSORTED}),
    C("sim-trace-starts-negative", SIM.replace("t.csv", "n.csv") + " --limit 3",
      files={"n.csv": HEADER + "-3,100,20\n0,100,20\n1.0,100,20\n"},
      accepted="a trace may start at any time, before 0 too: its arrivals are shifted to start at 0 s "
               "(docs/design.md, Workload trace)"),
]

PLAN_CASES = [
    C("plan-cluster-missing", PLAN_CMD.replace("{d}/c.yaml", "{d}/nope.yaml"), ("{d}/nope.yaml",)),
    C("plan-cluster-dir", PLAN_CMD.replace("{d}/c.yaml", "{d}/dir"), ("{d}/dir",)),
    C("plan-cluster-is-trace", PLAN_CMD.replace("{d}/c.yaml", "{d}/t.csv"), ("t.csv",)),
    C("plan-model-folder-no-config", PLAN_CMD.replace("llama-2-7b", "{d}/dir"), ("{d}/dir", "config.json")),
    C("plan-workload-empty", PLAN_CMD.replace("t.csv", "e.csv"), ("e.csv",), {"e.csv": ""}),
    C("plan-algorithm-unknown", PLAN_CMD + " --algorithm best", ("best", "hexgen2")),
    C("plan-compare-unknown", PLAN_CMD + " --compare hexgen2,magic", ("magic",)),
    C("plan-compare-only-commas", PLAN_CMD + " --compare ,", ("--compare",)),
    C("plan-efficiency-missing", PLAN_CMD + " --efficiency {d}/nope.json", ("nope.json",)),
    C("plan-efficiency-list", PLAN_CMD + " --efficiency {d}/e.json", ("e.json",), {"e.json": "[]"}),
    C("plan-cost-without-rate", PLAN_CMD + " --objective cost", ("--objective cost", "--rate")),
    C("plan-rate-without-cost", PLAN_CMD + " --rate 3", ("--rate", "cost")),
    C("plan-slo-under-throughput", PLAN_CMD + " --slo-ttft 1", ("--slo-ttft",)),
    C("plan-goodput-without-slo", PLAN_CMD + " --objective goodput", ("goodput", "--slo-ttft")),
    C("plan-output-is-input", PLAN_CMD + " -o {d}/t.csv", ("--output", "--workload")),
    C("plan-class-leaves-none", PLAN_CMD + " --workload-class HPHD", ("HPHD",)),
    C("plan-all-beyond-context", PLAN_CMD.replace("t.csv", "l.csv"), ("l.csv", "4096"), {"l.csv": LONG}),
    C("plan-trace-out-of-order", PLAN_CMD.replace("t.csv", "u.csv"), ("u.csv:3", "non-decreasing order"),
      {"u.csv": UNSORTED}),
    C("plan-algorithm-and-compare", PLAN_CMD + " --algorithm genetic --compare hexgen2", ("--algorithm", "--compare")),
    C("plan-disaggregated-hexgen", PLAN_CMD + " --algorithm hexgen --disaggregated", ("--disaggregated", "hexgen")),
    C("plan-disaggregated-uniform", PLAN_CMD + " --algorithm uniform --disaggregated",
      accepted="uniform's plans are prefill and decode replicas already: --disaggregated asks for what it does"),
    C("plan-model-does-not-fit", PLAN_CMD.replace("llama-2-7b", "llama-2-70b") + " --time-limit 2 --quiet",
      ("llama-2-70b",), real=True),
]

CAPACITY_CASES = [
    C("cap-gpu-unknown", CAP.replace("A100-SXM-80G", "H900") + " --rate 1", ("--gpu", "H900")),
    C("cap-cluster-missing", CAP.replace("--gpu A100-SXM-80G", "--cluster {d}/nope.yaml") + " --rate 1",
      ("{d}/nope.yaml",)),
    C("cap-no-rate", CAP, ("--rate",)),
    C("cap-rates-letters", CAP + " --rates a,b", ("--rates",)),
    C("cap-rates-commas", CAP + " --rates ,", ("--rates",)),
    C("cap-rates-nan", CAP + " --rates 1,nan --method fluid", ("--rates", "nan")),
    C("cap-rates-inf", CAP + " --rates 1,inf --method fluid", ("--rates", "inf")),
    C("cap-gpus-per-worker-odd", CAP + " --rate 1 --gpus-per-worker 3 --method fluid", ("--gpus-per-worker",)),
    C("cap-placement-under-fluid", CAP + " --rate 1 --method fluid --placement rr", ("--placement", "fluid")),
    C("cap-requests-under-fluid", CAP + " --rate 1 --method fluid --requests 50", ("--requests", "fluid")),
    C("cap-target-under-fluid", CAP + " --rate 1 --method fluid --target 0.9", ("--target", "fluid")),
    C("cap-model-missing", CAP.replace("llama-2-7b", "{d}/nope") + " --rate 1", ("{d}/nope",)),
    C("cap-all-beyond-context", CAP.replace("t.csv", "l.csv") + " --rate 1 --method fluid", ("l.csv", "4096"),
      {"l.csv": LONG}),
    C("cap-mixed-cluster", CAP.replace("--gpu A100-SXM-80G", "--cluster {d}/c.yaml") + " --rate 1 --method fluid",
      accepted="capacity sizes workers of one GPU type: a warning names the one used (the cluster's first) and "
               "the types left out"),
]

COMPARE_CASES = [
    C("cmp-plan-missing", CMP.replace("plan.json", "nope.json"), ("nope.json",)),
    C("cmp-workload-missing", CMP.replace("t.csv", "nope.csv"), ("nope.csv",)),
    C("cmp-plan-not-on-cluster", CMP + " --cluster demo-tiny", ("plan.json", "--model", "not in cluster demo-tiny")),
    C("cmp-efficiency-list", CMP + " --efficiency {d}/e.json", ("e.json",), {"e.json": "[]"}),
    C("cmp-rate-on-burst", CMP.replace("t.csv", "b.csv") + " --rate 5", ("b.csv", "one instant"), {"b.csv": BURST}),
    C("cmp-chunk-tokens-under-mixed", CMP + " --chunk-tokens 64", ("--chunk-tokens", "chunked")),
    C("cmp-speed-weight-without-correction", CMP + " --no-speed-correction --speed-weight 0.5",
      ("--speed-weight", "--no-speed-correction")),
    C("cmp-output-is-file", CMP + " -o {d}/t.csv", ("--output",)),
]

COST_CASES = [
    C("cost-gpu-unknown", LAYER.replace("H200", "H900"), ("H900",)),
    C("cost-model-missing", LAYER.replace("llama-2-7b", "{d}/nope"), ("{d}/nope",)),
    C("cost-tp-zero", LAYER + " --tp 0", ("--tp",)),
    C("cost-tp-letters", LAYER + " --tp a", ("--tp",)),
    C("cost-tp-not-dividing", LAYER + " --tp 5", ("--tp", "5")),
    C("cost-tokens-negative", LAYER + " --tokens=-1", ("--tokens",)),
    C("cost-table-missing", LAYER + " --table {d}/nope.json", ("nope.json",)),
    C("cost-table-list", LAYER + " --table {d}/k.json", ("k.json",), {"k.json": "[]"}),
    C("cost-table-misspelt", LAYER + " --table {d}/k.json", ("k.json",), {"k.json": json.dumps({"gpuz": {}})}),
    C("cost-fit-profiles-missing", "cost fit --profiles {d}/nope -o {d}/k.json", ("{d}/nope",)),
    C("cost-fit-profiles-empty", "cost fit --profiles {d}/dir -o {d}/k.json", ("{d}/dir",)),
    C("cost-fit-output-dir", "cost fit --profiles {d}/dir -o {d}/dir", ("{d}/dir",)),
]

EXPORT_CASES = [
    C("export-plan-missing", EXPORT.replace("plan.json", "nope.json"), ("nope.json",)),
    C("export-output-is-file", EXPORT.replace("{d}/out", "{d}/t.csv"), ("--output", "t.csv")),
    C("export-ray-port-past-range", EXPORT + " --ray-port 70000", ("--ray-port",)),
    C("export-ray-port-for-sglang", EXPORT.replace("vllm", "sglang") + " --ray-port 7000", ("--ray-port", "SGLang")),
    C("export-model-folder-no-config", EXPORT + " --model {d}/dir", ("{d}/dir", "config.json")),
    C("export-cluster-lacks-devices", EXPORT + " --cluster {d}/c.yaml", ("h100-0:0",)),
    C("export-engine-unknown", EXPORT.replace("vllm", "trt"), ("--to", "trt")),
    C("export-port-range-reversed", EXPORT.replace("vllm", "hetserve") + " --port-range 9-3", ("--port-range", "9-3")),
    C("export-port-range-for-vllm", EXPORT + " --port-range 7000-7010", ("--port-range", "--to hetserve")),
    C("export-output-not-empty", EXPORT.replace("{d}/out", "{d}/full"), ("--output", "a new or empty folder", "a.txt"),
      {"full/a.txt": "x"}),
    C("export-force-no-bundle", EXPORT.replace("{d}/out", "{d}/full") + " --force", ("--force", "no bundle.json"),
      {"full/a.txt": "x"}),
]

MAKE_MODEL_CASES = [
    C("mm-vocab-small", "make-model --vocab 100 -o {d}/x", ("--vocab", "259", "got 100")),
    # a shape error names the option given, and where the value it clashes with came from
    C("mm-heads-not-dividing", "make-model --heads 3 -o {d}/x",
      ("--heads", "a divisor of the hidden size (64, the default; pass --hidden)", "got 3")),
    C("mm-kv-heads-not-dividing", "make-model --kv-heads 3 -o {d}/x",
      ("--kv-heads", "a divisor of the heads (4, the default; pass --heads)", "got 3")),
    C("mm-heads-against-like", "make-model --like llama-2-7b --heads 4 --random-weights -o {d}/x",
      ("--heads", "a multiple of the KV heads (32, from --like llama-2-7b; pass --kv-heads)", "got 4")),
    C("mm-hidden-against-heads-given", "make-model --hidden 66 --heads 4 -o {d}/x",
      ("--hidden", "a multiple of --heads (4)", "got 66")),
    C("mm-kv-heads-on-opt", "make-model --arch opt --kv-heads 2 -o {d}/x", ("--kv-heads", "OPT", "got 2")),
    C("mm-output-is-file", "make-model -o {d}/t.csv", ("-o", "t.csv")),
    C("mm-layers-huge", "make-model --layers 1000000000 -o {d}/x", ("--layers",)),
    C("mm-hidden-huge", "make-model --hidden 1048576 --heads 4 -o {d}/x", ("--hidden",)),
    C("mm-vocab-huge", "make-model --vocab 100000000000 -o {d}/x", ("--vocab",)),
]

CALIBRATE_CASES = [
    C("cal-no-model", "calibrate", ("--model",)),
    C("cal-model-missing", CAL.replace("{d}/m", "{d}/nope"), ("{d}/nope", "--model")),
    C("cal-model-preset", CAL.replace("{d}/m", "llama-2-7b"), ("--model", "checkpoint folder")),
    C("cal-gpu-unknown", CAL + " --gpu H900", ("H900",)),
    C("cal-prompt-lengths-letters", CAL + " --prompt-lengths a", ("--prompt-lengths",)),
    C("cal-prompt-lengths-zero", CAL + " --prompt-lengths 0,32", ("--prompt-lengths",)),
    C("cal-batch-sizes-empty", CAL + " --batch-sizes ,", ("--batch-sizes",)),
    C("cal-prompt-beyond-context", CAL + " --prompt-lengths 32,4096", ("--prompt-lengths", "128")),
    C("cal-profiles-missing", "calibrate --profiles {d}/nope -o {d}/k.json", ("{d}/nope",)),
    C("cal-profiles-and-model", "calibrate --profiles {d}/dir --model {d}/m -o {d}/k.json", ("--profiles", "--model")),
    C("cal-profiles-and-probe-option", "calibrate --profiles {d}/dir --no-tp -o {d}/k.json", ("--profiles", "--no-tp")),
    C("cal-output-dir", CAL + " -o {d}/dir", ("{d}/dir",)),
]

ROUTE_CASES = [
    C("route-deploy-missing", "route --deploy {d}/nope.json --port 0", ("nope.json",)),
    C("route-deploy-dir", "route --deploy {d}/dir --port 0", ("{d}/dir",)),
    C("route-deploy-binary", "route --deploy {d}/x.json --port 0", ("x.json",), {"x.json": BINARY}),
    C("route-deploy-list", "route --deploy {d}/x.json --port 0", ("x.json",), {"x.json": "[]"}),
    C("route-deploy-is-plan", "route --deploy {d}/plan.json --port 0", ("plan.json",)),
    C("route-backends-commas", "route --backends , --port 0", ("--backends",)),
    C("route-backends-no-scheme", "route --backends localhost:8001 --port 0", ("--backends", "localhost:8001")),
    C("route-health-interval-negative", ROUTE + " --health-interval -1", ("--health-interval", ">= 0")),
    C("route-health-failures-zero", ROUTE + " --health-failures 0", ("--health-failures", "integer > 0")),
    C("route-backends-port-too-big", "route --backends http://127.0.0.1:99999 --port 0", ("--backends", "99999")),
    C("route-backends-twice", "route --backends http://127.0.0.1:1,http://127.0.0.1:1/ --port 0",
      ("--backends", "each backend once")),
    C("route-deploy-same-id", "route --deploy {d}/x.json --port 0", ("x.json", "replicas.1.id", "c0"),
      {"x.json": route_deploy(("c0", "colocated"), ("c0", "colocated"))}),
    C("route-deploy-prefill-only", "route --deploy {d}/x.json --port 0", ("x.json", "decode replica"),
      {"x.json": route_deploy(("p0", "prefill"), ("p1", "prefill"))}),
    C("route-deploy-decode-only", "route --deploy {d}/x.json --port 0", ("x.json", "prefill or colocated"),
      {"x.json": route_deploy(("d0", "decode"),)}),
    C("route-host-unknown", "route --backends http://127.0.0.1:1 --host no-such-host.invalid --port 0",
      ("no-such-host.invalid",)),
    C("route-backends-ftp", "route --backends ftp://h:1 --port 0", ("--backends", "ftp://h:1")),
    C("route-deploy-and-backends", "route --deploy {d}/x.json --backends http://h:1", ("--backends",)),
    C("route-key-file-missing", ROUTE + " --backend-api-key-file {d}/nope", ("{d}/nope",)),
    C("route-key-file-empty", ROUTE + " --backend-api-key-file {d}/k", ("{d}/k", "holds no key"), {"k": ("\n", 0o600)}),
    C("route-key-file-binary", ROUTE + " --backend-api-key-file {d}/k", ("{d}/k",), {"k": (BINARY, 0o600)}),
    C("route-key-file-two-keys", ROUTE + " --backend-api-key-file {d}/k", ("{d}/k", "one key"),
      {"k": ("a1\nb2\n", 0o600)}),
    C("route-key-file-world-readable", ROUTE + " --backend-api-key-file {d}/k", ("{d}/k", "chmod 600"), {"k": "key"}),
    # `hetserve export --to hetserve`: every replica behind the one server that routes them itself
    C("route-deploy-hetserve-engine", "route --deploy {d}/x.json --port 0",
      ("x.json", "field 'engine'", "routes between its replicas itself", "http://127.0.0.2:8000"),
      {"x.json": json.dumps({"engine": "hetserve", "router": {"endpoint": "http://127.0.0.2:8000"}, "replicas": [
          {"id": i, "role": role, "endpoint": "http://127.0.0.2:8000"} for i, role in (("p0", "prefill"),
                                                                                      ("d0", "decode"))]})}),
    C("route-deploy-same-endpoint", "route --deploy {d}/x.json --port 0", ("x.json", "replicas.1.endpoint", "p0 has it"),
      {"x.json": json.dumps({"engine": "vllm", "replicas": [{"id": i, "role": role, "endpoint": "http://127.0.0.1:9"}
                                                           for i, role in (("p0", "prefill"), ("d0", "decode"))]})}),
    C("route-backends-empty-entry", "route --backends http://127.0.0.1:1,,http://127.0.0.1:2 --port 0",
      ("--backends", "entry 1 is empty")),
    C("route-backends-v1-path", "route --backends http://127.0.0.1:8000/v1 --port 0", ("--backends", "drop /v1")),
    C("route-deploy-endpoint-path", "route --deploy {d}/x.json --port 0", ("x.json", "replicas.0.endpoint", "drop /v1"),
      {"x.json": json.dumps({"replicas": [{"id": "c0", "role": "colocated", "endpoint": "http://127.0.0.1:9/v1"}]})}),
]

SERVE_CASES = [
    C("serve-plan-missing", SERVE.replace("tiny.json", "nope.json"), ("nope.json",)),
    C("serve-cluster-missing", SERVE + " --cluster {d}/nope.yaml", ("{d}/nope.yaml",)),
    C("serve-model-other-layers", SERVE.replace("tiny.json", "plan.json"), ("{d}/m", "32", "planned for", "beyond m's")),
    C("serve-heartbeat-short", SERVE + " --heartbeat-timeout 0.1", ("--heartbeat-timeout",)),
    C("serve-replan-on-ray", SERVE + " --replan-on-failure --backend ray", ("--replan-on-failure", "ray")),
    C("serve-replan-workload-bad", SERVE + " --replan-on-failure --replan-workload {d}/nope.csv", ("nope.csv",)),
    C("serve-replan-workload-alone", SERVE + " --replan-workload {d}/t.csv", ("--replan-workload",
                                                                             "--replan-on-failure")),
    C("serve-replan-time-alone", SERVE + " --replan-time-limit 5", ("--replan-time-limit", "--replan-on-failure")),
    C("serve-time-scale-alone", SERVE + " --time-scale 4", ("--time-scale", "--shape-links")),
    C("serve-transmission-alone", SERVE + " --transmission molink", ("--transmission", "--shape-links")),
    C("serve-time-scale-zero", SERVE + " --shape-links --time-scale 0", ("--time-scale", "> 0")),
    C("serve-chunk-tokens-under-mixed", SERVE + " --chunk-tokens 64", ("--chunk-tokens", "chunked")),
    # a step decodes up to --max-num-seqs sequences within the budget, and no budget splits a prompt
    C("serve-max-batched-tokens-below-seqs", SERVE + " --max-batched-tokens 1",
      ("--max-batched-tokens", "got 1", "at least --max-num-seqs (256)", "--prefill-mode chunked --chunk-tokens")),
    C("serve-max-batched-tokens-below-given-seqs", SERVE + " --max-batched-tokens 8 --max-num-seqs 16",
      ("--max-batched-tokens", "got 8", "at least --max-num-seqs (16)")),
    C("serve-max-batched-tokens-under-chunked", SERVE + " --prefill-mode chunked --max-batched-tokens 512",
      ("--max-batched-tokens", "--prefill-mode mixed", "--chunk-tokens")),
    C("serve-ray-address-local", SERVE + " --ray-address 10.0.0.1:6379", ("--ray-address", "ray")),
    C("serve-slo-without-aladdin", SERVE + " --slo-ttft 1", ("--slo-ttft", "aladdin")),
    C("serve-tls-cert-only", SERVE + " --tls-cert {d}/t.csv", ("--tls-key",)),
    C("serve-tls-files-missing", SERVE + " --tls-cert {d}/a --tls-key {d}/b --tls-ca {d}/c", ("--tls-cert",)),
    C("serve-api-key-file-missing", SERVE + " --api-key-file {d}/nope", ("{d}/nope",)),
    C("serve-api-key-file-world-readable", SERVE + " --api-key-file {d}/k", ("{d}/k", "chmod 600"), {"k": "key"}),
    C("serve-admin-is-api-key", SERVE + " --api-key abcdefghijklmnop --admin-key abcdefghijklmnop", ("--admin-key",)),
    C("serve-protect-probes-open", SERVE + " --protect-probes", ("--protect-probes",)),
    C("serve-route-on-colocated", SERVE + " --route load", ("--route load", "no prefill replica")),
    C("serve-host-bogus", SERVE + " --host 999.1.1.1", ("999.1.1.1",)),
    C("serve-port-range-reversed", SERVE + " --port-range 5-3", ("--port-range", "LO <= HI", "'5-3'")),
]

COMMAND_CASES = (PLAN_FILE_CASES + SIMULATE_CASES + PLAN_CASES + CAPACITY_CASES + COMPARE_CASES + COST_CASES
                 + EXPORT_CASES + MAKE_MODEL_CASES + CALIBRATE_CASES + ROUTE_CASES + SERVE_CASES)
