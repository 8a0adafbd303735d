"""Live weight updates: from a checkpoint folder and from a trainer process over a
collective. After an update the engine must produce exactly what a fresh engine on the new
weights produces; a bad update must be rejected with an error naming the tensor while the
old weights keep serving; requests already running finish on the old weights."""

from __future__ import annotations

import asyncio
import json
import multiprocessing
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from portaserve import LLM
from portaserve.framework.errors import InvalidParameterError

from .util import ENGINE_KW, free_port, generate_ids, greedy, prompts_of

ARCH = "Qwen2ForCausalLM"
PROMPTS = prompts_of([5, 40, 21], seed=3)


def _tensors(folder) -> dict[str, torch.Tensor]:
    return load_file(str(Path(folder) / "model.safetensors"))


def _variant(src, dst: Path, change) -> str:
    """A copy of checkpoint `src` whose tensors `change(tensors)` edited in place."""
    shutil.copytree(src, dst)
    tensors = _tensors(src)
    change(tensors)
    save_file(tensors, str(dst / "model.safetensors"))
    return str(dst)


@pytest.fixture(scope="module")
def folders(checkpoint):
    return checkpoint(ARCH, 0), checkpoint(ARCH, 1)


@pytest.fixture(scope="module")
def llm(folders):
    engine = LLM(folders[0], **ENGINE_KW)
    yield engine
    engine.shutdown()


@pytest.fixture()
def old_weights(llm, folders):
    """The module's engine, back on checkpoint seed 0 after the test."""
    yield llm
    llm.update_weights(folders[0])


# ----- from a checkpoint folder ---------------------------------------------------------------


def test_update_from_folder_equals_a_fresh_engine(old_weights, folders, reference_ids):
    llm = old_weights
    old, new = reference_ids(PROMPTS, 8, ARCH, 0), reference_ids(PROMPTS, 8, ARCH, 1)
    assert old != new
    version = llm.weights_version
    first = llm.generate(PROMPTS, greedy(8), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in first] == old
    assert all(o.weights_version == version for o in first)
    again = llm.generate(PROMPTS[1:2], greedy(8), use_tqdm=False)[0]
    assert again.num_cached_tokens >= 32  # the 40-token prompt's full blocks are cached

    result = llm.update_weights(folders[1])
    assert result["weights_version"] == version + 1 == llm.weights_version
    assert result["num_tensors"] > 0 and result["num_bytes"] > 0
    outs = llm.generate(PROMPTS, greedy(8), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == new
    assert all(o.weights_version == version + 1 for o in outs)
    # the prefix cache was reset: the old weights' K/V is never reused
    assert outs[1].num_cached_tokens == 0


@pytest.mark.slow
def test_update_from_folder_under_tp2(folders, reference_ids):
    new = reference_ids(PROMPTS, 8, ARCH, 1)
    llm = LLM(folders[0], tensor_parallel_size=2, **ENGINE_KW)
    try:
        assert generate_ids(llm, PROMPTS) == reference_ids(PROMPTS, 8, ARCH, 0)
        llm.update_weights(folders[1])
        assert generate_ids(llm, PROMPTS) == new
        assert llm.weights_version == 1
    finally:
        llm.shutdown()


@pytest.mark.slow
@pytest.mark.parametrize("tp", [1, 2])
def test_int8_engine_takes_float_updates(tp, folders):
    """An engine that quantized its checkpoint online stages a float update in the
    checkpoint's layout and quantizes it again: it then equals a fresh int8 engine on the
    new weights (the same float shards quantize to the same int8 ones; under TP a
    row-parallel shard has its own scales, so the reference runs at the same TP size)."""
    kw = dict(ENGINE_KW, quantization="int8", dtype="bfloat16", tensor_parallel_size=tp)

    def fresh_ids(folder):
        engine = LLM(folder, **kw)
        try:
            return generate_ids(engine, PROMPTS)
        finally:
            engine.shutdown()

    want_old, want_new = fresh_ids(folders[0]), fresh_ids(folders[1])
    assert want_old != want_new
    llm = LLM(folders[0], **kw)
    try:
        assert generate_ids(llm, PROMPTS) == want_old
        result = llm.update_weights(folders[1])
        assert result["weights_version"] == 1
        assert generate_ids(llm, PROMPTS) == want_new
        llm.update_weights(folders[0])  # the re-registered int8 parameters take a second update
        assert generate_ids(llm, PROMPTS) == want_old
    finally:
        llm.shutdown()


@pytest.mark.parametrize("case", ["missing_folder", "wrong_shape", "unknown_tensor", "missing_tensor", "integer_tensor",
                                  "other_architecture"])
def test_bad_folder_is_rejected_and_old_weights_keep_serving(case, llm, folders, checkpoint, reference_ids, tmp_path):
    base = folders[1]
    bad_name = "model.layers.1.mlp.down_proj.weight"
    if case == "missing_folder":
        folder, expect = str(tmp_path / "nope"), "is not a folder"
    elif case == "wrong_shape":
        folder = _variant(base, tmp_path / "v", lambda t: t.__setitem__(bad_name, t[bad_name][:, :100].clone()))
        expect = f"{bad_name}' has shape [64, 100], the serving model expects [64, 160]"
    elif case == "unknown_tensor":
        folder = _variant(base, tmp_path / "v", lambda t: t.__setitem__("model.layers.9.extra.weight", torch.zeros(2)))
        expect = "unknown tensor 'model.layers.9.extra.weight'"
    elif case == "missing_tensor":
        folder = _variant(base, tmp_path / "v", lambda t: t.pop(bad_name))
        expect = "missing parameter"
    elif case == "integer_tensor":
        folder = _variant(base, tmp_path / "v", lambda t: t.__setitem__(bad_name, t[bad_name].to(torch.int32)))
        expect = f"{bad_name}' has dtype torch.int32"
    else:
        folder = checkpoint("LlamaForCausalLM", 1)
        expect = "LlamaForCausalLM"
    version = llm.weights_version
    with pytest.raises(InvalidParameterError, match=expect.replace("[", r"\[").replace("]", r"\]")):
        llm.update_weights(folder)
    assert llm.weights_version == version
    assert generate_ids(llm, PROMPTS) == reference_ids(PROMPTS, 8, ARCH, 0)


# ----- from a trainer process over a collective ----------------------------------------------


def _trainer(port: int, world_size: int, jobs, results) -> None:
    """A stand-in trainer: joins the group as rank 0, then broadcasts what each job names."""
    from portaserve.framework.executor.weight_transfer import TrainerWeightSender

    try:
        sender = TrainerWeightSender("127.0.0.1", port, world_size, timeout_s=60)
        results.put("joined")
        while (job := jobs.get()) is not None:
            folder, names = job
            tensors = _tensors(folder)
            results.put(sender.send((n, tensors[n]) for n in names))
        sender.close()
    except BaseException as exc:  # reported to the test, which would otherwise wait
        results.put(f"trainer failed: {type(exc).__name__}: {exc}")


class Trainer:
    def __init__(self, world_size: int) -> None:
        ctx = multiprocessing.get_context("spawn")
        self.port = free_port()
        self.jobs, self.results = ctx.Queue(), ctx.Queue()
        self.proc = ctx.Process(target=_trainer, args=(self.port, world_size, self.jobs, self.results), daemon=True)
        self.proc.start()

    def result(self):
        value = self.results.get(timeout=120)
        assert not (isinstance(value, str) and value.startswith("trainer failed")), value
        return value

    def close(self) -> None:
        self.jobs.put(None)
        self.proc.join(timeout=30)
        if self.proc.is_alive():
            self.proc.kill()


def _specs(folder, names):
    tensors = _tensors(folder)
    return list(names), [str(tensors[n].dtype) for n in names], [list(tensors[n].shape) for n in names]


def _distributed_update(llm, trainer, folder, names, *, shapes=None, dtypes=None, engine_names=None):
    """One update: the trainer broadcasts `names` of `folder`; the engine is told
    `engine_names`/`dtypes`/`shapes` (default: the truth). Returns (engine result or error, trainer's send)."""
    trainer.jobs.put((folder, names))
    want_names, want_dtypes, want_shapes = _specs(folder, names)
    try:
        result = llm.update_weights_from_distributed(engine_names or want_names, dtypes or want_dtypes,
                                                     shapes or want_shapes)
    except InvalidParameterError as exc:
        result = exc
    return result, trainer.result()


@pytest.mark.slow
@pytest.mark.parametrize("tp", [1, 2])
def test_update_from_distributed(tp, folders, reference_ids, tmp_path):
    a, b = folders
    old, new = reference_ids(PROMPTS, 8, ARCH, 0), reference_ids(PROMPTS, 8, ARCH, 1)
    llm = LLM(a, tensor_parallel_size=tp, **ENGINE_KW)
    trainer = Trainer(world_size=1 + tp)
    try:
        info = llm.init_weight_update_group("127.0.0.1", trainer.port, rank_offset=1, world_size=1 + tp)
        assert info["world_size"] == 1 + tp
        assert trainer.result() == "joined"
        names = sorted(_tensors(b))

        # bad announcements: rejected before any tensor moves; the trainer is told, nothing hangs
        bad_shapes = _specs(b, names)[2]
        k = names.index("model.layers.0.self_attn.k_proj.weight")
        bad_shapes[k] = [bad_shapes[k][0] * 2, bad_shapes[k][1]]
        for kwargs, message in [
            (dict(shapes=bad_shapes), "model.layers.0.self_attn.k_proj.weight' has shape [64, 64]"),
            (dict(dtypes=["bfloat16"] * len(names)), "has dtype torch.bfloat16, the engine runs in torch.float32"),
            (dict(engine_names=names[:-1] + ["model.no_such.weight"]), "unknown tensor 'model.no_such.weight'"),
        ]:
            result, sent = _distributed_update(llm, trainer, b, names, **kwargs)
            assert isinstance(result, InvalidParameterError) and message.replace("[", "") in str(result).replace("[", ""), result
            assert sent is False
            assert llm.weights_version == 0
            assert generate_ids(llm, PROMPTS) == old

        # a partial update (two tensors, one of them part of the fused q/k/v) equals a
        # fresh engine on a checkpoint with just those two tensors replaced
        part = ["model.layers.0.self_attn.k_proj.weight", "model.layers.1.mlp.gate_proj.weight"]
        new_b = _tensors(b)
        mixed = _variant(a, tmp_path / "mixed", lambda t: t.update({n: new_b[n] for n in part}))
        result, sent = _distributed_update(llm, trainer, b, part)
        assert sent is True and result["weights_version"] == 1, result
        fresh = LLM(mixed, **ENGINE_KW)
        try:
            want_mixed = generate_ids(fresh, PROMPTS)
        finally:
            fresh.shutdown()
        assert want_mixed not in (old, new)
        assert generate_ids(llm, PROMPTS) == want_mixed

        # every tensor: equals a fresh engine on checkpoint b
        result, sent = _distributed_update(llm, trainer, b, names)
        assert sent is True and result["weights_version"] == 2, result
        outs = llm.generate(PROMPTS, greedy(8), use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == new
        assert all(o.weights_version == 2 for o in outs)
        llm.destroy_weight_update_group()
    finally:
        trainer.close()
        llm.shutdown()


def test_update_from_distributed_needs_a_group(llm, folders):
    names, dtypes, shapes = _specs(folders[1], ["model.norm.weight"])
    with pytest.raises(InvalidParameterError, match="init_weight_update_group"):
        llm.update_weights_from_distributed(names, dtypes, shapes)
    with pytest.raises(InvalidParameterError, match="rank_offset"):
        llm.init_weight_update_group("127.0.0.1", free_port(), rank_offset=0, world_size=2)
    with pytest.raises(InvalidParameterError, match="world_size"):
        llm.init_weight_update_group("127.0.0.1", free_port(), rank_offset=1, world_size=1)


# ----- requests in flight ----------------------------------------------------------------------


@pytest.mark.slow
def test_running_requests_finish_on_the_old_weights_new_ones_wait(folders, reference_ids):
    """Through the engine-core process (what `serve` runs): a request that is generating
    when the update is called finishes entirely on the old weights; one sent while the
    update waits runs on the new weights; weights_version says which."""
    from portaserve.framework.config import EngineConfig
    from portaserve.framework.engine.core_client import AsyncLLM
    from portaserve.framework.engine.params import RequestOutputKind

    a, b = folders
    long_prompt, short_prompt = PROMPTS[0], PROMPTS[2]
    want_old = reference_ids([long_prompt], 48, ARCH, 0)[0]
    want_new = reference_ids([short_prompt], 8, ARCH, 1)[0]
    assert reference_ids([long_prompt], 48, ARCH, 1)[0] != want_old

    async def run() -> None:
        engine = AsyncLLM(EngineConfig.create(model=a, **ENGINE_KW))
        await engine.start()
        try:
            started = asyncio.Event()

            async def generate(rid, prompt, n):
                params = greedy(n)
                params.output_kind = RequestOutputKind.CUMULATIVE
                last = None
                async for last in engine.generate(rid, prompt, params):
                    started.set()
                return last

            first = asyncio.create_task(generate("running", long_prompt, 48))
            await started.wait()
            update = asyncio.create_task(engine.call("update_weights", b))
            await asyncio.sleep(0.2)  # the update reaches the engine before the next request
            second = asyncio.create_task(generate("waiting", short_prompt, 8))
            old_out, result, new_out = await asyncio.wait_for(asyncio.gather(first, update, second), 120)
            assert old_out.outputs[0].token_ids == want_old
            assert old_out.weights_version == 0
            assert result["weights_version"] == 1 == engine.weights_version
            assert new_out.outputs[0].token_ids == want_new
            assert new_out.weights_version == 1
            info = await engine.call("weights_info")
            assert info["weights_version"] == 1
            assert json.dumps(info)  # plain data, for the HTTP routes
        finally:
            await engine.shutdown()

    asyncio.run(run())
