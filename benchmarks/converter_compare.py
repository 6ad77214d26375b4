"""The converter decision, measured: the project's own HF <-> Megatron converter
(engine/policy/hf_convert.py and the family modules) against mbridge, on every builtin tiny family, on the policy the
engine builds (Megatron's local, non-TE spec on CPU). Per family, one line:

- ours: the policy loads the HF checkpoint, its fp32 logits' largest difference from HF's, and the export's
  tensors that differ from the checkpoint (0 = byte-exact round trip);
- mbridge: whether it has a bridge for the model_type, what its `get_model` does here (the first line of its
  error), and of the policy's parameter names how many its name map sends to tensors the HF checkpoint holds;
- then the lines of code of each.

    PYTHONPATH=$PWD:/path/to/mbridge_site python -m benchmarks.converter_compare [--families qwen2,deepseek_v3]

mbridge is not a dependency: without it the mbridge columns say "not installed". Prints; writes nothing (README
"Converter" quotes its output with the mbridge version). Not a test: nothing here asserts.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import torch


def _ours(model_dir: str) -> tuple[list[str], float, int]:
    """(the policy's parameter names, max |logit - HF logit| in fp32, export tensors not bit-equal)."""
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoModelForCausalLM

    from engine.config import ModelConfig, ParallelConfig
    from engine.policy.hf_checkpoint import export_hf_checkpoint, load_hf_checkpoint
    from engine.policy.hf_map import ModelDims
    from engine.policy.microbatch import MicroBatch
    from engine.policy.model import build_policy, policy_shape
    from engine.policy.parallel import destroy_parallel, init_parallel
    from engine.policy.step import lm_head_logits, run_schedule

    cfg, parallel = ModelConfig(dtype="float32"), ParallelConfig()
    ps = init_parallel(parallel, seed=0)
    try:
        hf_config = AutoConfig.from_pretrained(model_dir)
        dims = ModelDims.from_hf(hf_config, policy_shape(hf_config, cfg, 1).padded_vocab_size)
        chunks = build_policy(hf_config, cfg, ps, None)
        load_hf_checkpoint(chunks, ps, model_dir, dims)
        names = [n for n, _ in chunks[0].named_parameters()]
        tokens = torch.randint(0, hf_config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))

        def logits_fn(model, hidden, _batch):  # (s, b, H) -> loss 0 and the logits (b, s, V)
            logits = lm_head_logits(hidden, model.lm_head_weight(), ps, model.final_logit_softcap, model.logit_scale)
            return logits.sum() * 0, {"logits": logits.transpose(0, 1)[..., :hf_config.vocab_size].detach()}

        chunks[0].eval()
        with torch.no_grad():
            batch = MicroBatch(tokens=tokens, position_ids=torch.arange(12).expand(2, 12))
            ours = run_schedule(chunks, ps, [batch], logits_fn, forward_only=True)[0]["logits"]
            eager = {"attn_implementation": "eager"} if hf_config.model_type == "gemma2" else {}
            hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, **eager).eval()(tokens).logits
        with tempfile.TemporaryDirectory() as out:
            export_hf_checkpoint(chunks, ps, out, hf_config, dims, tokenizer_dir=model_dir)
            before, after = _tensors(model_dir, load_file), _tensors(out, load_file)
        differ = sum(1 for k, v in before.items() if k not in after or not torch.equal(after[k], v))
        return names, float((ours - hf).abs().max()), differ + len(set(after) - set(before))
    finally:
        destroy_parallel()


def _tensors(directory: str, load_file) -> dict[str, torch.Tensor]:
    out = {}
    for path in sorted(Path(directory).glob("*.safetensors")):
        out.update(load_file(str(path)))
    return out


def _mbridge(model_dir: str, names: list[str], hf_names: set[str]) -> str:
    """What mbridge does with this checkpoint and the policy's names (a megatron world of 1 must be up)."""
    try:
        from mbridge import AutoBridge
        from mbridge.core.auto_bridge import _MODEL_REGISTRY
    except ImportError:
        return "mbridge: not installed"
    from transformers import AutoConfig

    from engine.config import ParallelConfig
    from engine.policy.parallel import destroy_parallel, init_parallel

    init_parallel(ParallelConfig(), seed=0)
    try:
        model_type = AutoConfig.from_pretrained(model_dir).model_type
        if model_type not in _MODEL_REGISTRY:
            return f"mbridge: no bridge for {model_type}"
        try:
            bridge = AutoBridge.from_pretrained(model_dir, dtype=torch.float32)
        except Exception as error:  # noqa: BLE001 - the measurement is what fails and why
            return f"mbridge: {_MODEL_REGISTRY[model_type].__name__} fails to construct: {_line(error)}"
        try:
            bridge.get_model(wrap_with_ddp=False)
            built = "get_model builds"
        except Exception as error:  # noqa: BLE001
            built = f"get_model fails: {_line(error)}"
        mapped = 0
        for name in names:
            try:
                hf = bridge._weight_name_mapping_mcore_to_hf(name)
                mapped += bool(hf) and all(h in hf_names for h in hf)
            except Exception:  # noqa: BLE001 - an unknown name counts as unmapped
                pass
        return f"mbridge: {type(bridge).__name__}, {built}; maps {mapped}/{len(names)} of the policy's names"
    finally:
        destroy_parallel()


def _line(error: Exception) -> str:
    return f"{type(error).__name__}: {str(error).splitlines()[0][:120] if str(error) else ''}"


def main(argv: list[str] | None = None) -> None:
    from safetensors.torch import load_file

    from engine.models.tiny_model import TINY_FAMILIES, build_tiny_model

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--families", default=",".join(TINY_FAMILIES))
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as root:
        for family in args.families.split(","):
            model_dir = str(build_tiny_model(Path(root) / family, family, seed=7))
            try:
                names, logit_diff, differ = _ours(model_dir)
                ours = f"ours: loads, max |logit diff| {logit_diff:.2g}, export tensors differing {differ}"
            except Exception as error:  # noqa: BLE001
                names, ours = [], f"ours: fails: {_line(error)}"
            print(f"{family}: {ours}; {_mbridge(model_dir, names, set(_tensors(model_dir, load_file)))}", flush=True)
    print(_code_size())


def _code_size() -> str:
    """Lines of Python: the project's converter (the maps, the checkpoint reader / writer, the family modules, which
    also hold each family's layer spec) and mbridge's package where installed (its specs and VLM bridges too)."""
    root = Path(__file__).resolve().parent.parent / "engine"
    skip = {"__init__.py", "tiny_model.py", "hub.py", "model_dir.py"}  # test models and name resolution, not conversion
    ours = [root / "policy" / "hf_convert.py", root / "policy" / "hf_checkpoint.py",
            *sorted(p for p in (root / "models").glob("*.py") if p.name not in skip)]
    line = f"code: ours {sum(len(p.read_text().splitlines()) for p in ours)} lines ({len(ours)} files)"
    try:
        import mbridge
    except ImportError:
        return line
    files = sorted(Path(mbridge.__file__).parent.rglob("*.py"))
    return f"{line}; mbridge {sum(len(p.read_text().splitlines()) for p in files)} lines ({len(files)} files, VLMs too)"


if __name__ == "__main__":
    main()
