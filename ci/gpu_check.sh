#!/usr/bin/env bash
# shellcheck disable=SC2317  # the step_* functions run through `bash -c` under timeout
# The GPU check: portaserve on an NVIDIA GPU, on a machine with no internet access.
#
#   ci/gpu_wheels.sh                 # where pip can reach PyPI: the wheels into .whl
#   ci/gpu_check.sh                  # on the GPU machine, from a copy of the repo with .whl
#
# The machine's python3 must already hold torch (a CUDA build), Triton, transformers,
# pluggy, tokenizers, safetensors, numpy and pytest. The script installs the carried wheels
# that python lacks (or holds older) and portaserve itself (no network, no build
# isolation) into a fresh --target folder put first on PYTHONPATH (its bin/ on PATH), so
# the `portaserve` command and the entry points (platforms, the kit's pytest plugin) are
# registered as in a real install. Then each step prints a PASS or FAIL line:
#
#   1. probe   `portaserve platforms`: every plugin loads, the cuda platform is available
#              and `--device auto` selects it
#   2. kit     the conformance kit on cuda (pytest --pyargs portaserve.framework.testing
#              --platform cuda; --allow-single-device where the kit has it and one GPU is
#              visible: NCCL ranks cannot share a GPU)
#   3. triton  tests/kernels/test_triton_kernels.py, test_triton_backend.py and test_gguf_matmul.py compiled on the
#              GPU (TRITON_INTERPRET unset, PORTASERVE_TRITON_TEST_DEVICE=cuda): every
#              kernel against its torch reference, the whole grid
#   4. parity  tiny random-weight checkpoints (Qwen2, Llama, Qwen3) generated greedily by
#              portaserve.LLM(device="cuda", dtype="float32") and by transformers' generate
#              on the same GPU: token-identical, eager and with compilation_mode="default"
#   5. bench   `portaserve bench kernels` (timings for BENCHMARKS.md, JSON beside the log)
#
# The exit status is 1 when any step failed. The whole log goes to $OUT/gpu_check.log when
# OUT is set (else into the work folder, printed at the end). About 5 minutes on an H200;
# each step has a time cap, and all of them together stay inside GPU_CHECK_BUDGET seconds.
#
# Environment:
#   PYTHON               the interpreter (default python3)
#   GPU_CHECK_WHEELS     the wheels folder (default .whl at the repository root)
#   GPU_CHECK_DEVICE     the platform under test (default cuda). GPU_CHECK_DEVICE=cpu is a dry
#                        run of the plumbing on a machine without GPU: the same steps on the
#                        CPU platform, the Triton tests through the interpreter (fast tier).
#   GPU_CHECK_BUDGET     seconds for the whole run (default 540)
#   GPU_CHECK_XDIST      pytest-xdist workers for step 3 where xdist is installed (default 8; 0: off)
#   GPU_CHECK_KIT_ARGS   extra arguments for the kit's pytest command line
#   GPU_CHECK_STEPS      the steps to run (default "probe kit triton parity bench"), e.g. a rerun
#                        of one step when little GPU time is left
#   GPU_CHECK_INSTALL    pip (default: pip, falling back to a plain copy) or copy
#   GPU_CHECK_KEEP       set: keep the work folder's install and checkpoints (default: removed)
set -uo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="${PYTHON:-python3}"
DEVICE="${GPU_CHECK_DEVICE:-cuda}"
WHEELS="${GPU_CHECK_WHEELS:-$ROOT/.whl}"
BUDGET="${GPU_CHECK_BUDGET:-540}"
XDIST="${GPU_CHECK_XDIST:-8}"
KIT_ARGS="${GPU_CHECK_KIT_ARGS:-}"
INSTALL="${GPU_CHECK_INSTALL:-pip}"
STEPS=" ${GPU_CHECK_STEPS:-probe kit triton parity bench} "
WORK="$(mktemp -d "${TMPDIR:-/tmp}/gpu-check.XXXXXX")"
SITE="$WORK/site"
if [ -n "${OUT:-}" ]; then
    mkdir -p "$OUT"
    ARTIFACTS="$OUT"
else
    ARTIFACTS="$WORK"
fi
LOG="$ARTIFACTS/gpu_check.log"
START=$SECONDS
RESULTS=()
FAILED=0

# A clean environment: no device or plugin selection from outside, no interpreter, no hub.
unset TRITON_INTERPRET PORTASERVE_DEVICE PORTASERVE_PLUGINS PORTASERVE_DISABLE_PLUGIN_AUTOLOAD \
    PORTASERVE_STRICT_PLUGINS PORTASERVE_TRITON_TEST_DEVICE
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false \
    HF_HUB_DISABLE_PROGRESS_BARS=1 TQDM_DISABLE=1
export PY DEVICE SITE WORK ROOT ARTIFACTS KIT_ARGS XDIST

say() { printf '[%4ds] %s\n' $((SECONDS - START)) "$*"; }

# step NAME CAP_SECONDS FUNCTION: run FUNCTION (exported) under a time limit, record PASS/FAIL.
step() {
    local name="$1" cap="$2" fn="$3" left limit rc t0
    [[ "$STEPS" == *" $name "* ]] || return 0
    left=$((BUDGET - (SECONDS - START) - 5))
    limit=$((cap < left ? cap : left))
    echo
    say "=== step $name (limit ${limit}s)"
    if [ "$limit" -lt 10 ]; then
        RESULTS+=("FAIL  $name: not run, the ${BUDGET}s budget is spent")
        FAILED=1
        say "=== FAIL $name: not run, the ${BUDGET}s budget is spent"
        return
    fi
    t0=$SECONDS
    timeout --kill-after=10 "$limit" bash -c "$fn"
    rc=$?
    if [ "$rc" -eq 0 ]; then
        RESULTS+=("PASS  $name ($((SECONDS - t0))s)")
        say "=== PASS $name ($((SECONDS - t0))s)"
    else
        local why="exit status $rc"
        if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then why="timed out after ${limit}s"; echo; fi
        RESULTS+=("FAIL  $name ($why, $((SECONDS - t0))s)")
        FAILED=1
        say "=== FAIL $name ($why)"
    fi
}

# ----- setup: what the machine has, the wheels, portaserve ----------------------------------

machine() {
    say "repo $ROOT, work folder $WORK, device under test: $DEVICE"
    uname -srm
    command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
    "$PY" - <<'EOF'
import importlib.metadata as md, platform, sys
print("python", platform.python_version(), sys.executable)
for name in ("torch", "triton", "transformers", "pluggy", "tokenizers", "safetensors", "numpy", "pytest",
             "pytest-xdist", "pytest-timeout", "pip", "setuptools", "packaging"):
    try:
        print(f"  {name} {md.version(name)}")
    except md.PackageNotFoundError:
        print(f"  {name} (not installed)")
import torch
print("torch", torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available(),
      "devices", torch.cuda.device_count())
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    print(f"  {p.name}, capability {p.major}.{p.minor}, {p.total_memory / 2**30:.0f} GiB, {p.multi_processor_count} SMs")
EOF
}

# Print the carried wheels this python lacks (or holds older); notes go to stderr.
select_wheels() {
    "$PY" - "$@" <<'EOF'
import importlib.metadata as md, os, re, sys
try:
    from packaging.version import Version
except ImportError:
    Version = None
seen = {}
for path in sys.argv[1:]:
    name, version = os.path.basename(path).split("-")[:2]
    key = re.sub(r"[-_.]+", "-", name).lower()
    if key in seen:
        sys.exit(f"two wheels of {key} in the wheels folder: {os.path.basename(seen[key])}, {os.path.basename(path)}")
    seen[key] = path
    try:
        have = md.version(key)
    except md.PackageNotFoundError:
        have = None
    if have is None:
        print(f"  install {key} {version} (missing)", file=sys.stderr)
        print(path)
    elif Version is not None and Version(have) < Version(version):
        print(f"  install {key} {version} (this python has {have})", file=sys.stderr)
        print(path)
    else:
        print(f"  skip    {key} {version} (this python has {have})", file=sys.stderr)
EOF
}

# portaserve without pip: the packages pyproject.toml maps, package data, and a dist-info with
# the entry points and the console script, as a wheel would lay them out.
copy_install() {
    "$PY" - "$WORK/src" "$SITE" <<'EOF'
import fnmatch, os, shutil, stat, sys
try:
    import tomllib
except ImportError:  # Python < 3.11
    import tomli as tomllib
src, site = sys.argv[1:]
project = tomllib.load(open(os.path.join(src, "pyproject.toml"), "rb"))
meta, tool = project["project"], project["tool"]["setuptools"]
package_dir = tool.get("package-dir", {})
data = tool.get("package-data", {})
for pkg in tool["packages"]:
    parts = pkg.split(".")
    for n in range(len(parts), 0, -1):  # the longest mapped prefix
        prefix = ".".join(parts[:n])
        if prefix in package_dir:
            folder = os.path.join(src, package_dir[prefix], *parts[n:])
            break
    else:
        folder = os.path.join(src, *parts)
    dest = os.path.join(site, *parts)
    os.makedirs(dest, exist_ok=True)
    patterns = data.get(pkg, [])
    for f in os.listdir(folder):
        if os.path.isfile(os.path.join(folder, f)) and (f.endswith(".py") or any(fnmatch.fnmatch(f, p) for p in patterns)):
            shutil.copy2(os.path.join(folder, f), dest)
info = os.path.join(site, f"{meta['name']}-{meta['version']}.dist-info")
os.makedirs(info, exist_ok=True)
with open(os.path.join(info, "METADATA"), "w") as f:
    f.write(f"Metadata-Version: 2.1\nName: {meta['name']}\nVersion: {meta['version']}\n")
with open(os.path.join(info, "entry_points.txt"), "w") as f:
    groups = dict(meta.get("entry-points", {}))
    if meta.get("scripts"):
        groups["console_scripts"] = meta["scripts"]
    for group, eps in groups.items():
        f.write(f"[{group}]\n" + "".join(f"{k} = {v}\n" for k, v in eps.items()) + "\n")
open(os.path.join(info, "INSTALLER"), "w").write("ci/gpu_check.sh\n")
os.makedirs(os.path.join(site, "bin"), exist_ok=True)
for name, target in meta.get("scripts", {}).items():
    module, func = target.split(":")
    path = os.path.join(site, "bin", name)
    with open(path, "w") as f:
        f.write(f"#!{sys.executable}\nimport sys\nfrom {module} import {func}\nsys.exit({func}())\n")
    os.chmod(path, os.stat(path).st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
print(f"  copied portaserve {meta['version']} into {site}")
EOF
}

setup() {
    local wheels=() selected=() w
    mkdir -p "$SITE" "$WORK/src"
    # a copy of the sources to build from (the build writes build/ and *.egg-info there, not
    # here), without what no package of pyproject.toml holds
    tar -C "$ROOT" --exclude=./.git --exclude=./.whl --exclude=./.gl --exclude=./.venv --exclude=./.cache \
        --exclude=./shared --exclude=./build --exclude=./dist --exclude=./bench-results --exclude=./tests \
        --exclude=./benchmarks --exclude=./examples --exclude='*.egg-info' --exclude=__pycache__ \
        -cf - . | tar -C "$WORK/src" -xf - || return 1
    if [ -d "$WHEELS" ]; then
        for w in "$WHEELS"/*.whl; do [ -f "$w" ] && wheels+=("$w"); done
    fi
    say "wheels carried in $WHEELS: ${#wheels[@]}"
    [ "${#wheels[@]}" -gt 0 ] || say "no wheels: where pip reaches PyPI, ci/gpu_wheels.sh writes them into .whl"
    if [ "${#wheels[@]}" -gt 0 ]; then
        select_wheels "${wheels[@]}" >"$WORK/wheels.txt" || return 1
        mapfile -t selected <"$WORK/wheels.txt"
    fi
    if [ "${#selected[@]}" -gt 0 ]; then
        "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$SITE" "${selected[@]}" \
            >"$WORK/pip-wheels.log" 2>&1 || { cat "$WORK/pip-wheels.log"; say "installing the wheels failed"; return 1; }
    fi
    if [ "$INSTALL" = pip ]; then
        say "installing portaserve with pip (--no-deps --no-build-isolation --no-index --target)"
        if ! "$PY" -m pip install -q --no-deps --no-build-isolation --no-index --no-compile --no-cache-dir \
                --target "$SITE" "$WORK/src" >"$WORK/pip-portaserve.log" 2>&1; then
            tail -n 30 "$WORK/pip-portaserve.log"
            say "pip could not build portaserve here: copying the packages instead"
            INSTALL=copy
        fi
    fi
    if [ "$INSTALL" = copy ]; then
        copy_install || return 1
    fi
    export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}" PATH="$SITE/bin:$PATH"
    # from the work folder, so that the repository root is not on sys.path
    (cd "$WORK" && "$PY" - <<'EOF'
import importlib.metadata as md, os, sys
import portaserve, pydantic
site = os.environ["SITE"]
assert portaserve.__file__.startswith(site), f"portaserve imported from {portaserve.__file__}, not {site}"
print(f"  portaserve {portaserve.__version__} from {os.path.dirname(portaserve.__file__)}, pydantic {pydantic.VERSION}")
platforms = sorted(ep.name for ep in md.entry_points(group="portaserve.platforms"))
pytest11 = sorted(ep.name for ep in md.entry_points(group="pytest11"))
print(f"  entry points: portaserve.platforms {platforms}; pytest11 {pytest11}")
device = os.environ["DEVICE"]
assert {"cpu", device} <= set(platforms), f"no {device} platform entry point"
assert "portaserve" in pytest11, "the conformance kit's pytest plugin is not registered"
EOF
    ) || return 1
    say "portaserve command: $(command -v portaserve)"
}

# ----- the steps (each runs in its own bash under `timeout`) --------------------------------

step_probe() {
    cd "$WORK" || return 1
    portaserve --version || return 1
    portaserve platforms --device "$DEVICE" --strict-plugins || return 1
    portaserve platforms --json --strict-plugins >"$ARTIFACTS/platforms.json" || { cat "$ARTIFACTS/platforms.json"; return 1; }
    "$PY" - "$ARTIFACTS/platforms.json" <<'EOF'
import json, os, sys
doc = json.load(open(sys.argv[1]))
device = os.environ["DEVICE"]
bad = [p["name"] for p in doc["plugins"] if p["error"] or not (p["loaded"] or p["skipped"])]
assert not bad, f"plugins not loaded cleanly: {bad}"
for p in doc["plugins"]:
    if p["skipped"]:
        print(f"plugin {p['name']} skipped: {p['skipped']}")
entry = next((p for p in doc["platforms"] if p["name"] == device), None)
assert entry is not None, f"no {device} platform in the report"
assert entry["available"], f"{device} is unavailable: {entry['reason']}"
print(f"{device}: {entry['reason']}; device {entry['device']}")
caps = entry.get("capabilities") or {}
print(f"  features {caps.get('features')}, block sizes {caps.get('block_sizes')}, "
      f"compile {caps.get('compile_backends')} (default mode {caps.get('default_compilation_mode')})")
print(f"  attention {entry.get('preferred_attention_backends')}, communicator {entry.get('default_communicator')}, "
      f"KV allocator {entry.get('default_kv_cache_allocator')}; warnings {entry.get('warnings')}")
sel = doc["selection"]
assert sel["error"] is None, sel["error"]
assert sel["selected"] == device, f"--device auto selected {sel['selected']}, not {device}: {sel['reason']}"
print(f"--device auto selects {sel['selected']}: {sel['reason']}")
EOF
}

step_kit() {
    local args=() count
    cd "$WORK" || return 1  # a vendor's CI runs the kit from anywhere: no repository conftest
    count=$("$PY" -c "import json,sys; d=json.load(open(sys.argv[1])); print(next((p['device'] or {}).get('count', 0) for p in d['platforms'] if p['name'] == sys.argv[2]))" \
        "$ARTIFACTS/platforms.json" "$DEVICE" 2>/dev/null || echo 0)
    if [ "$DEVICE" != cpu ] && [ "${count:-0}" -lt 2 ] \
            && grep -q -- '--allow-single-device' "$SITE/portaserve/framework/testing/pytest_plugin.py" 2>/dev/null; then
        echo "$count $DEVICE device(s): --allow-single-device (the world-size-2 collectives need one device per rank)"
        args+=(--allow-single-device)
    fi
    # shellcheck disable=SC2086  # KIT_ARGS: words
    "$PY" -m pytest -q -p no:cacheprovider --pyargs portaserve.framework.testing --platform "$DEVICE" "${args[@]}" $KIT_ARGS
}

step_triton() {
    local args=(-q -p no:cacheprovider -rfE)
    cd "$ROOT" || return 1  # the repository's tests: tests/conftest.py, pyproject's pytest settings
    if [ "$DEVICE" = cpu ]; then
        args+=(-m "not slow")  # the interpreter: the fast tier
    elif [ "$XDIST" -gt 0 ] && "$PY" -c "import xdist" 2>/dev/null; then
        args+=(-n "$XDIST")  # kernel compilation in parallel
    fi
    echo "PORTASERVE_TRITON_TEST_DEVICE=$DEVICE, TRITON_INTERPRET unset (the tests set it themselves on cpu)"
    env -u TRITON_INTERPRET PORTASERVE_TRITON_TEST_DEVICE="$DEVICE" \
        "$PY" -m pytest "${args[@]}" tests/kernels/test_triton_kernels.py tests/kernels/test_triton_backend.py tests/kernels/test_gguf_matmul.py
}

step_parity() {
    cd "$WORK" || return 1  # not the repository root: its kernels/ would shadow the hub's package
    mkdir -p "$WORK/checkpoints"
    cat >"$WORK/parity.py" <<'EOF'
"""Greedy tokens of portaserve.LLM vs transformers' generate, same checkpoint, same device."""
import gc, os, sys, tempfile, time

import torch
import transformers

from portaserve import LLM, SamplingParams
from portaserve.models.checkpoints import write_checkpoint

device = os.environ["DEVICE"]
ARCHS = ("Qwen2ForCausalLM", "LlamaForCausalLM", "Qwen3ForCausalLM")
# compilation modes: None is the platform's default; "default" is CUDA graphs on cuda
MODES = (None, "default") if device != "cpu" else (None,)
LENGTHS, NEW = (3, 11, 29, 60), 24


def sync():
    if device != "cpu":
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def ours(folder, prompts, mode):
    llm = LLM(model=folder, device=device, dtype="float32", skip_tokenizer_init=True, kv_cache_memory=1.0,
              max_model_len=256, compilation_mode=mode)
    for line in str(llm.plan).splitlines():  # what was chosen, without the rejected alternatives
        if line.strip().startswith(("platform", "attention", "kv_cache_allocator", "compilation", "ops", "block_size")):
            print("   ", line.strip())
    params = SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    llm.shutdown()
    del llm, outs
    gc.collect()
    sync()
    return tokens


def theirs(folder, prompts):
    try:
        model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    except TypeError:  # transformers < 4.56
        model = transformers.AutoModelForCausalLM.from_pretrained(folder, torch_dtype=torch.float32)
    model = model.to(device).eval()
    model.generation_config.eos_token_id = None  # NEW tokens, whatever they are
    tokens, gaps = [], []
    with torch.no_grad():
        for p in prompts:
            ids = torch.tensor([p], device=device)
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW, do_sample=False,
                                 pad_token_id=0, output_scores=True, return_dict_in_generate=True)
            tokens.append(out.sequences[0, len(p):].tolist())
            gaps.append([float(s[0].topk(2).values.diff().abs()) for s in out.scores])
    del model
    gc.collect()
    sync()
    return tokens, gaps


failures = 0
for arch in ARCHS:
    folder = tempfile.mkdtemp(prefix=f"{arch}-", dir=os.path.join(os.environ["WORK"], "checkpoints"))
    write_checkpoint(arch, "tiny", folder, 0, tokenizer=False)
    vocab = transformers.AutoConfig.from_pretrained(folder).vocab_size
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in LENGTHS]
    t0 = time.perf_counter()
    ref, gaps = theirs(folder, prompts)
    print(f"{arch}: transformers {transformers.__version__} on {device}, {time.perf_counter() - t0:.1f}s")
    for mode in MODES:
        t0 = time.perf_counter()
        try:
            got = ours(folder, prompts, mode)
        except Exception as exc:  # report it, go on with the other modes and architectures
            import traceback

            traceback.print_exc()
            print(f"FAIL {arch} compilation_mode={mode}: {type(exc).__name__}: {exc}")
            failures += 1
            continue
        bad = [i for i in range(len(prompts)) if got[i] != ref[i]]
        distinct = sum(len(set(t)) for t in got) / len(got)
        verdict = "ok  " if not bad and distinct >= 4 else "FAIL"
        print(f"{verdict} {arch} compilation_mode={mode}: {len(prompts) - len(bad)}/{len(prompts)} prompts "
              f"token-identical over {NEW} new tokens ({distinct:.1f} distinct tokens per continuation, "
              f"{time.perf_counter() - t0:.1f}s)")
        for i in bad:
            j = next(k for k in range(NEW) if k >= len(got[i]) or got[i][k] != ref[i][k])
            print(f"    prompt {i} ({len(prompts[i])} tokens) diverges at new token {j}: ours {got[i][j:j + 4]}, "
                  f"transformers {ref[i][j:j + 4]}; transformers' top-2 logit gap there {gaps[i][j]:.3g}")
        if bad or distinct < 4:  # a continuation repeating one token would hide a misread KV cache
            failures += 1
print(f"float32 matmul precision: {torch.get_float32_matmul_precision()}")
sys.exit(1 if failures else 0)
EOF
    "$PY" "$WORK/parity.py"
}

step_bench() {
    cd "$WORK" || return 1
    if [ "$DEVICE" = cpu ]; then  # no GPU: the interpreter's smoke run on tiny shapes
        TRITON_INTERPRET=1 portaserve bench kernels --device cpu --json "$ARTIFACTS/bench_kernels.json"
    else
        portaserve bench kernels --device "$DEVICE" --iters 20 --warmup 3 --json "$ARTIFACTS/bench_kernels.json"
    fi
}

export -f step_probe step_kit step_triton step_parity step_bench

# ----- the run --------------------------------------------------------------------------------

main() {
    say "ci/gpu_check.sh: log $LOG"
    machine
    echo
    say "=== setup: wheels and portaserve into $SITE"
    if setup; then
        say "=== PASS setup ($((SECONDS - START))s)"
        RESULTS+=("PASS  setup")
        step probe 150 step_probe
        step kit 300 step_kit
        step triton 300 step_triton
        step parity 300 step_parity
        step bench 150 step_bench
    else
        say "=== FAIL setup: the steps need portaserve installed; none was run"
        RESULTS+=("FAIL  setup (no step run)")
        FAILED=1
    fi
    echo
    say "=== summary (device $DEVICE, $((SECONDS - START))s)"
    printf '  %s\n' "${RESULTS[@]}"
    if [ "$FAILED" -eq 0 ]; then
        say "GPU CHECK PASSED"
    else
        say "GPU CHECK FAILED"
    fi
    # the installed copy and the checkpoints go (about 200 MB); the log and reports stay
    [ -n "${GPU_CHECK_KEEP:-}" ] || rm -rf "$WORK/src" "$WORK/site" "$WORK/checkpoints"
    [ "$ARTIFACTS" = "$WORK" ] && say "log and reports in $WORK"
    return "$FAILED"
}

main 2>&1 | tee "$LOG"
exit "${PIPESTATUS[0]}"
