"""`glmq upload`: the model card, the validation gate, the dry run and the Hub calls, all without the network.

Every test replaces the HfApi methods `glmq upload` may call with recorders (`hub` fixture), so a test
that reached the network would fail on the recorded calls rather than upload anything.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

import httpx
import pytest
import torch
import yaml
from click.testing import CliRunner
from huggingface_hub import HfApi, ModelCard
from huggingface_hub.errors import HfHubHTTPError

from glmq.formats import model_card as mc
from glmq.formats.manifest import fingerprint
from glmq.quantize import stream
from glmq.scripts import upload
from glmq.scripts.cli import main
from test_validate import EXPERT, InProcessConfigJob, convert, flip_packed_byte

REPO = "glmq-test/GLM-5-tiny-W4A16"
EVAL = {"text": "/data/prose.txt", "seq_len": 256, "windows": 96, "models": [
    {"checkpoint": "/ckpt/glm5-tiny-fp8", "perplexity": 3.9115, "kl_to_source": 0.0, "layer_rel_error": None},
    {"checkpoint": "/out/ckpt", "perplexity": 3.9342, "kl_to_source": 0.01234, "layer_rel_error": [0.01, 0.03, 0.02]},
]}


# ----------------------------------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def written(make_ckpt, tmp_path_factory):
    """The glm_moe_dsa int4-w4a16 output, converted once (compressed-tensors config built in-process)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(stream, "ConfigJob", InProcessConfigJob)
        return convert(make_ckpt("glm_moe_dsa", "fp8-block"), tmp_path_factory.mktemp("written") / "ckpt", "int4-w4a16")


@pytest.fixture
def ckpt(written, tmp_path):
    """A private copy of the written checkpoint (named `ckpt`, like the eval report's row)."""
    return Path(shutil.copytree(written, tmp_path / "out" / "ckpt"))


class Calls(list):
    """(method name, {"args": positional, **keywords}) of each recorded HfApi call."""

    def recorder(self, name: str, doc: str | None):
        def method(api, *args, **kw):
            self.append((name, {"args": args, **kw}))
        method.__doc__ = doc  # upload_method reads the docstring (deprecation), so keep the installed one
        return method


@pytest.fixture
def hub(monkeypatch):
    """Record every HfApi call glmq upload can make; a token is set, no request leaves the machine."""
    calls = Calls()
    for name in ("create_repo", "create_branch", "upload_folder", "upload_large_folder", "upload_file", "create_commit",
                 "_validate_yaml"):
        monkeypatch.setattr(HfApi, name, calls.recorder(name, getattr(HfApi, name).__doc__))
    monkeypatch.setattr("huggingface_hub.get_token", lambda: "hf_test_token")
    return calls


def run(*args: str):
    return CliRunner().invoke(main, ["upload", *args], catch_exceptions=False)


def yaml_block(text: str) -> dict:
    m = re.match(r"---\n(.*?)\n---\n", text, flags=re.S)
    assert m, text[:200]
    return yaml.safe_load(m[1])


def listing(output: str) -> dict[str, int]:
    """{file: bytes} from the dry run's listing (lines `   1,234  name`; the total line excluded)."""
    rows = re.findall(r"^\s*([\d,]+)  (\S.*)$", output, flags=re.M)
    return {name: int(n.replace(",", "")) for n, name in rows if not name.startswith("total")}


def card_inputs(root: Path, **kw) -> mc.CardInputs:
    read = lambda n: json.loads((root / n).read_text())  # noqa: E731
    base = dict(repo_id=REPO, checkpoint_name=root.name, config=read("config.json"), report=read("glmq_report.json"),
                manifest=read("glmq_manifest.json"), validation={"valid": True, "settings": {}, "checks": {}})
    return mc.CardInputs(**{**base, **kw})


# ----------------------------------------------------------------------------------------- the card
def test_card_yaml_parses_and_has_the_metadata(written):
    card = mc.build_card(card_inputs(written, base_model="zai-org/GLM-5", license="mit", tp=4))
    meta = yaml_block(str(card))
    assert meta["base_model"] == "zai-org/GLM-5" and meta["base_model_relation"] == "quantized"
    assert meta["library_name"] == "transformers" and meta["pipeline_tag"] == "text-generation"
    assert meta["license"] == "mit"
    assert {"compressed-tensors", "int4", "w4a16", "rtn", "glm_moe_dsa"} <= set(meta["tags"])
    loaded = ModelCard(str(card))  # huggingface_hub reads back what it wrote
    assert loaded.data.base_model == "zai-org/GLM-5" and loaded.data.to_dict()["base_model_relation"] == "quantized"


def test_card_body_quantization_sizes_and_serve_commands(written):
    report = json.loads((written / "glmq_report.json").read_text())
    text = str(mc.build_card(card_inputs(written, tp=4)))
    assert mc.is_glmq_card(text)
    assert "| group_0 | `Linear` | int | 4 | 128 | yes | none | pack-quantized |" in text
    assert "| routed_expert | quantize | 72 |" in text and "| attention | dequantize | 20 |" in text
    assert "`lm_head`" in text  # kept unquantized, from the config's ignore list
    assert "name: int4-w4a16" in text and "method: rtn" in text  # the recipe, as a recipe file
    # both rows are file sizes: the source's shards and this folder's (bytes_out counts tensors only: headers not in)
    files = sum(p.stat().st_size for p in written.glob("*.safetensors"))
    assert files > report["bytes_out"]
    assert (f"| source (fp8-block) | {mc.human_bytes(report['bytes_in_total'])} |" in text
            and f"| this checkpoint | {mc.human_bytes(files)} ({files / report['bytes_in_total']:.2f}x) |" in text)
    assert f"vllm serve {REPO} --tensor-parallel-size 4\n" in text
    assert f"python -m sglang.launch_server --model-path {REPO} --tp 4\n" in text
    assert "## Evaluation" not in text and mc.UNVALIDATED_WARNING not in text
    rev = str(mc.build_card(card_inputs(written, tp=8, revision="int4-g128")))
    assert "--tensor-parallel-size 8 --revision int4-g128" in rev and "--tp 8 --revision int4-g128" in rev


def test_card_of_a_keep_fp8_checkpoint_says_mixed_precision_and_fp8_activations(written):
    """keep_fp8 writes a `mixed-precision` config whose FP8 block group runs with dynamic FP8 activations: the card
    said "Weight-only ... `pack-quantized` format (INT weights, BF16 activations)" for it too."""
    config = json.loads((written / "config.json").read_text())
    qc = config["quantization_config"]
    qc["format"] = "mixed-precision"
    qc["config_groups"]["group_1"] = {
        "targets": ["re:^model\\.layers\\.0\\.mlp\\.down_proj$"], "format": "float-quantized",
        "weights": {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "block", "block_structure": [128, 128]},
        "input_activations": {"num_bits": 8, "type": "float", "strategy": "group", "group_size": 128, "dynamic": True}}
    text = str(mc.build_card(card_inputs(written, config=config)))
    assert "Weight-only" not in text and "`pack-quantized` format" not in text and "activations stay BF16" not in text
    assert "in the compressed-tensors `mixed-precision` format" in text and "dynamic FP8 activations" in text
    plain = str(mc.build_card(card_inputs(written)))  # the INT-only checkpoint keeps its wording
    assert "Weight-only quantization of" in plain and "`pack-quantized` format (INT weights, BF16 activations)" in plain


def test_serve_commands_trust_remote_code_when_the_checkpoint_ships_custom_code(written):
    """Kimi K2 (and DeepSeek-V3) checkpoints carry an auto_map to code in the folder; transformers refuses a kimi_k2
    config without trust_remote_code, so the card's vLLM and SGLang commands did not start such a checkpoint."""
    config = json.loads((written / "config.json").read_text())
    plain = str(mc.build_card(card_inputs(written, tp=4)))
    assert "--trust-remote-code" not in plain  # GLM-5: no custom code, no flag
    kimi = {**config, "model_type": "kimi_k2", "auto_map": {"AutoConfig": "configuration_deepseek.DeepseekV3Config"}}
    text = str(mc.build_card(card_inputs(written, config=kimi, tp=4, revision="int4")))
    assert f"vllm serve {REPO} --tensor-parallel-size 4 --revision int4 --trust-remote-code\n" in text
    assert f"python -m sglang.launch_server --model-path {REPO} --tp 4 --revision int4 --trust-remote-code\n" in text
    tokenizer = {"tokenizer_class": "TikTokenTokenizer", "auto_map": {"AutoTokenizer": ["tokenization_kimi.X", None]}}
    text = str(mc.build_card(card_inputs(written, tokenizer_config=tokenizer)))
    assert text.count(" --trust-remote-code\n") == 2


def test_upload_card_reads_the_tokenizers_auto_map(ckpt, hub):
    tok = json.loads((ckpt / "tokenizer_config.json").read_text())
    (ckpt / "tokenizer_config.json").write_text(json.dumps({**tok, "auto_map": {"AutoTokenizer": ["tok.T", None]}}))
    r = run(str(ckpt), "--repo-id", REPO, "--tp", "1", "--dry-run")
    assert r.exit_code == 0, r.output
    assert f"vllm serve {REPO} --tensor-parallel-size 1 --trust-remote-code\n" in r.stdout
    assert "warning: base model unknown, not recorded in config.json or glmq_report.json; the card leaves " \
           "base_model out (pass --base-model ORG/NAME)" in r.output  # the hint goes to the uploader, not the card


def test_eval_table_appears_iff_an_eval_report_is_given(written):
    without = str(mc.build_card(card_inputs(written)))
    with_eval = str(mc.build_card(card_inputs(written, eval_result=EVAL)))
    assert "## Evaluation" not in without and "3.9342" not in without
    assert "## Evaluation" in with_eval
    assert "| source (`glm5-tiny-fp8`) | 3.9115 | 0.00000 | - |" in with_eval
    assert "| **this checkpoint** (`ckpt`) | 3.9342 | 0.01234 | 0.0200 / 0.0300 |" in with_eval


def test_base_model_inferred_or_said_unknown(written):
    cfg = json.loads((written / "config.json").read_text())
    assert mc.infer_base_model({**cfg, "_name_or_path": "zai-org/GLM-5-FP8"}, None)[0] == "zai-org/GLM-5-FP8"
    hf_cache = {"source": "/root/.cache/huggingface/hub/models--zai-org--GLM-5-FP8/snapshots/abc123"}
    assert mc.infer_base_model(cfg, hf_cache)[0] == "zai-org/GLM-5-FP8"
    for local in ("/models/GLM-5-FP8", "./GLM-5-FP8", ".glmq-cache/glm5-tiny-fp8", "GLM-5-FP8"):
        assert mc.infer_base_model({**cfg, "_name_or_path": local}, {"source": local})[0] is None, local
    text = str(mc.build_card(card_inputs(written)))  # the tiny fixture records a local folder only
    assert "base_model" not in yaml_block(text) and "base_model_relation" not in yaml_block(text)
    assert "unknown base model (not recorded in config.json or glmq_report.json)" in text
    assert "--base-model" not in text  # the uploader's hint is printed by `glmq upload`, not published in the card


def made_with(text: str) -> str:
    m = re.search(r"Made with:\n\n```bash\n(glmq quantize [^\n]*)\n```", text)
    assert m, text
    return m[1]


def gptq_card(written: Path, settings, max_shard_bytes: int | None = None, device: str = "cpu") -> str:
    """The card of `written` as if GPTQ had made it with `settings` (what calibration/report.py records)."""
    report = json.loads((written / "glmq_report.json").read_text())
    report["recipe"]["method"], report["device"] = "gptq", device
    report["gptq"] = {"settings": settings.identity() | {"activations": settings.activations,
                                                         "offload_activations": settings.offload_activations,
                                                         "sequential": settings.sequential},
                      "calibration_tokens": 256, "by_class": {}}
    manifest = json.loads((written / "glmq_manifest.json").read_text())
    if max_shard_bytes is not None:
        manifest["identity"]["max_shard_bytes"] = max_shard_bytes
    return str(mc.build_card(card_inputs(written, report=report, manifest=manifest)))


def test_card_command_remakes_every_recorded_gptq_setting(written):
    """The "Made with" command, parsed by `glmq quantize` itself, gives back the run's identity and shard size."""
    import shlex

    from glmq.calibration.engine import CalibrationSettings
    from glmq.scripts.cli import parse_size, quantize

    settings = CalibrationSettings(calibration="my calib.txt", samples=8, seq_len=32, seed=3, min_expert_tokens=4,
                                   all_token_limit=2.5, sequential=True, activations="memory")
    cmd = made_with(gptq_card(written, settings))
    p = quantize.make_context("quantize", shlex.split(cmd)[2:]).params
    extra = {k: p[k] for k in ("min_expert_tokens", "all_token_limit") if p[k] is not None}
    replay = CalibrationSettings(calibration=p["calibration"], samples=p["samples"], seq_len=p["seq_len"],
                                 seed=p["seed"], sequential=p["true_sequential"], **extra)  # as cli.quantize builds it
    assert replay.identity() == settings.identity(), cmd
    assert "--true-sequential" in cmd and "--min-expert-tokens 4" in cmd and "--all-token-limit 2.5" in cmd
    written_shards = json.loads((written / "glmq_manifest.json").read_text())["identity"]["max_shard_bytes"]
    assert written_shards == 400_000 and parse_size(p["max_shard_size"]) == written_shards and "400KB" in cmd
    assert "--activations" not in cmd and "--offload-activations" not in cmd  # they change no bit
    assert "--device" not in cmd and "Python API" not in gptq_card(written, settings)


def test_card_command_leaves_the_local_folders_of_the_calibration_file_out(written):
    """The public card printed `--calibration /home/alice/private/calib.jsonl`, the uploader's folders."""
    from glmq.calibration.engine import CalibrationSettings

    base = "glmq quantize --model FP8_SOURCE_FOLDER --recipe recipe.yaml -o OUT --calibration "
    for spec, shown in (("/home/alice/private/calib.jsonl", "calib.jsonl"), ("../d/c.txt", "c.txt"),
                        ("allenai/c4", "allenai/c4"), ("data/alice/c.txt", "c.txt"), ("data/c.txt", "c.txt"),
                        ("allenai/c4:en", "allenai/c4:en"), ("scratch/team/wiki", "wiki")):
        assert made_with(gptq_card(written, CalibrationSettings(calibration=spec), 5 * 10**9)) == base + shown, spec


def test_card_command_prints_only_what_differs_from_the_defaults(written):
    from glmq.calibration.engine import CalibrationSettings

    base = "glmq quantize --model FP8_SOURCE_FOLDER --recipe recipe.yaml -o OUT"
    assert made_with(gptq_card(written, CalibrationSettings(calibration="c.txt"), 5 * 10**9)) == base + " --calibration c.txt"
    rtn = json.loads((written / "glmq_manifest.json").read_text())
    assert made_with(str(mc.build_card(card_inputs(written)))) == base + " --max-shard-size 400KB"
    rtn["identity"]["max_shard_bytes"] = 5 * 2**30
    assert made_with(str(mc.build_card(card_inputs(written, manifest=rtn)))) == base + " --max-shard-size 5GiB"
    rtn["identity"]["max_shard_bytes"] = 5 * 10**9
    cuda = json.loads((written / "glmq_report.json").read_text()) | {"device": "cuda"}  # RTN: CUDA == CPU bytes
    assert made_with(str(mc.build_card(card_inputs(written, manifest=rtn, report=cuda)))) == base
    # GPTQ on CUDA sums in another order than on a CPU; settings no option sets are named under the command
    text = gptq_card(written, CalibrationSettings(calibration="c.txt", expert_prior=0.5, all_token_limit=None),
                     5 * 10**9, device="cuda")
    assert made_with(text) == base + " --device cuda --calibration c.txt"
    assert "(no command-line option): `all_token_limit=None`, `expert_prior=0.5`." in text


def test_card_command_tables_match_the_cli_and_calibration_settings():
    """Every `glmq quantize` option is either in the card's command or known not to change the output."""
    import dataclasses

    from glmq.calibration import engine
    from glmq.calibration.engine import CalibrationSettings
    from glmq.scripts.cli import parse_size, quantize

    defaults = {f.name: f.default for f in dataclasses.fields(CalibrationSettings)}
    cli = quantize.make_context("quantize", []).params  # every option at its default
    for key, flag, default in mc.GPTQ_OPTIONS:
        assert defaults[key] == default, key
        assert cli[flag.lstrip("-").replace("-", "_")] in (default, None), flag  # None: CalibrationSettings' default
    assert cli["true_sequential"] is False and defaults["sequential"] is False
    assert all(defaults[k] == d for k, d in mc.GPTQ_API_ONLY.items()) and not set(mc.GPTQ_API_ONLY) & set(cli)
    identity = set(CalibrationSettings(sequential=True).identity())
    assert identity == {k for k, _, _ in mc.GPTQ_OPTIONS} | set(mc.GPTQ_API_ONLY) | {"calibration", "sequential"}
    assert parse_size(cli["max_shard_size"]) == mc.DEFAULT_MAX_SHARD_BYTES
    in_card = {"max_shard_size", "calibration", "true_sequential", "device"} | {
        f.lstrip("-").replace("-", "_") for _, f, _ in mc.GPTQ_OPTIONS}
    placeholders_or_no_bit = {"model", "recipe", "output", "scheme", "no_progress", "json_out", "activations",
                              "offload_activations", "experts_per_pass",  # --scheme: the recipe file carries the method
                              "trust_remote_code"}
    assert set(engine.NOT_IDENTITY) <= placeholders_or_no_bit
    assert set(cli) == in_card | placeholders_or_no_bit, set(cli) ^ (in_card | placeholders_or_no_bit)


# ----------------------------------------------------------------------------------------- the gate
def test_gate_refuses_a_corrupt_checkpoint_without_calling_the_hub(ckpt, hub):
    shard = flip_packed_byte(ckpt)
    r = run(str(ckpt), "--repo-id", REPO, "--tp", "1")
    assert r.exit_code == 1, r.output
    assert "did not pass glmq validate (failed checks: integrity" in r.output and "--allow-invalid" in r.output
    assert "--tp N" not in r.output  # a damaged checkpoint is not fixed by another tensor-parallel degree
    assert shard in r.output and f"{EXPERT}.weight_packed" in r.output  # validate's table names the damage
    assert hub == [] and not (ckpt / "README.md").exists()


def test_gate_checks_serving_at_the_tp_of_the_serve_commands(ckpt, hub):
    r = run(str(ckpt), "--repo-id", REPO)  # default --tp 8: the tiny experts (128 rows) do not split 8 ways
    assert r.exit_code == 1 and "failed checks: serving" in r.output and "--tp 8" in r.output
    # the fix a serving failure needs most often (`glmq validate` passed at its default --tp 1) is named
    assert "pass that as --tp N" in r.output.splitlines()[-1], r.output[-600:]
    assert hub == []


def test_allow_invalid_uploads_with_the_warning_in_the_card(ckpt, hub):
    flip_packed_byte(ckpt)
    r = run(str(ckpt), "--repo-id", REPO, "--tp", "1", "--allow-invalid")
    assert r.exit_code == 0, r.output
    assert "WARNING: uploading" in r.output and "did not pass glmq validate" in r.output
    assert [c[0] for c in hub] == ["create_repo", upload.upload_method(HfApi(), None), "upload_file"]
    card = (ckpt / "README.md").read_text()
    assert mc.UNVALIDATED_WARNING in card and "glmq validate: INVALID, failed integrity" in card
    assert "| integrity | fail |" in card
    r = run(str(ckpt), "--repo-id", REPO, "--tp", "1", "--allow-invalid", "--dry-run")  # says what it would do
    assert r.exit_code == 0 and "WARNING: would upload" in r.output and "WARNING: uploading" not in r.output


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine where validate cannot run on CUDA")
def test_validation_that_cannot_run_refuses_unless_allowed(ckpt, hub):
    r = run(str(ckpt), "--repo-id", REPO, "--tp", "1", "--device", "cuda")
    assert r.exit_code == 2 and "glmq validate could not run" in r.output and "no CUDA device" in r.output
    assert "a --device this machine has" in r.output and "to upload it unvalidated" in r.output
    assert hub == []
    r = run(str(ckpt), "--repo-id", REPO, "--tp", "1", "--device", "cuda", "--allow-invalid")
    assert r.exit_code == 0 and "WARNING: uploading" in r.output and len(hub) == 3
    card = (ckpt / "README.md").read_text()
    assert mc.UNVALIDATED_WARNING in card and "glmq validate could not run" in card


# ----------------------------------------------------------------------------------------- dry run
def test_dry_run_lists_exactly_the_files_and_sizes_and_calls_nothing(ckpt, hub, monkeypatch):
    monkeypatch.setattr("huggingface_hub.get_token", lambda: None)  # a dry run needs no token
    cache = ckpt / ".glmq-gptq"
    cache.mkdir()
    (cache / "calibration.json").write_text("{}")
    (cache / "layer-00001.safetensors").write_bytes(b"x" * 10)
    (ckpt / "model-00002-of-00006.safetensors.glmq-tmp").write_bytes(b"half")
    (ckpt / "hidden-00001.tmp").write_bytes(b"act")
    (ckpt / "glmq_manifest.rank00001.json").write_text("{}")  # a stopped rerun of a distributed job leaves these
    (ckpt / "glmq_manifest.rank00001.journal.jsonl").write_text("{}\n")
    (ckpt / "glmq_manifest.journal.jsonl").write_text("{}\n")
    (ckpt / ".cache" / "huggingface").mkdir(parents=True)
    (ckpt / ".cache" / "huggingface" / "upload.lock").write_text("")
    before = {p: p.stat().st_mtime_ns for p in ckpt.rglob("*")}
    r = run(str(ckpt), "--repo-id", REPO, "--tp", "1", "--dry-run")
    assert r.exit_code == 0, r.output
    expected = {}
    for dirpath, dirs, files in os.walk(ckpt):
        dirs[:] = [d for d in dirs if d not in (".glmq-gptq", ".cache")]
        for f in files:
            if not f.endswith((".glmq-tmp", ".tmp", ".journal.jsonl")) and not f.startswith("glmq_manifest.rank") \
                    and f != ".glmq-source-times.json":
                p = Path(dirpath) / f
                expected[p.relative_to(ckpt).as_posix()] = p.stat().st_size
    card = r.stdout.split("--- README.md (would be written) ---\n", 1)[1][:-1]  # echo's own newline off
    expected["README.md"] = len(card.encode())
    # the run report is listed at the size it is sent with (local paths cut to their names), not its size on disk
    expected["glmq_report.json"] = len(upload.public_report(ckpt / "glmq_report.json"))
    assert expected["glmq_report.json"] < (ckpt / "glmq_report.json").stat().st_size
    got = listing(r.stdout)
    assert got == expected
    assert f"{sum(expected.values()):,d}  total" in r.stdout
    for skipped in (".glmq-gptq/calibration.json", "model-00002-of-00006.safetensors.glmq-tmp", "hidden-00001.tmp",
                    "glmq_manifest.rank00001.json", "glmq_manifest.rank00001.journal.jsonl",
                    "glmq_manifest.journal.jsonl", ".glmq-source-times.json"):
        assert f"skipped  {skipped}" in r.stdout
    assert yaml_block(card)["tags"][0] == "compressed-tensors"
    assert hub == [] and not (ckpt / "README.md").exists()
    assert {p: p.stat().st_mtime_ns for p in ckpt.rglob("*")} == before  # nothing written


def test_real_upload_sends_what_the_dry_run_listed(ckpt, hub):
    (ckpt / ".glmq-gptq").mkdir()
    (ckpt / ".glmq-gptq" / "report.json").write_text("{}")
    dry = run(str(ckpt), "--repo-id", REPO, "--tp", "1", "--dry-run")
    real = run(str(ckpt), "--repo-id", REPO, "--tp", "1")
    assert dry.exit_code == 0 and real.exit_code == 0, real.output
    files, skipped = upload.split_files(ckpt)  # what the Hub client's own filter keeps, after the card is written
    files = upload.published_sizes(files, upload.public_report(ckpt / "glmq_report.json"))
    assert listing(dry.stdout) == listing(real.stdout) == files
    assert skipped == [".glmq-gptq/report.json", ".glmq-source-times.json"]  # (local file times: manifest.py)
    sent = [call for name, call in hub if name == "upload_file"]
    assert [len(c["path_or_fileobj"]) for c in sent] == [files["glmq_report.json"]]  # listed as sent


# ----------------------------------------------------------------------------------------- Hub calls
def test_upload_calls_the_hub_with_repo_private_revision_and_patterns(ckpt, hub):
    r = run(str(ckpt), "--repo-id", REPO, "--tp", "1", "--private", "--base-model", "zai-org/GLM-5")
    assert r.exit_code == 0, r.output
    (name, create), (method, call), (report, sent) = hub
    assert name == "create_repo" and create["args"] == (REPO,)
    assert create["private"] is True and create["exist_ok"] is True and create["repo_type"] == "model"
    assert method == upload.upload_method(HfApi(), None)
    assert call["repo_id"] == REPO and Path(call["folder_path"]) == ckpt and call["revision"] is None
    assert upload.ignore_patterns() == [".glmq-gptq/*", "*.glmq-tmp", "*.tmp", "glmq_manifest.rank*.json",
                                        "glmq_manifest*.journal.jsonl", "glmq_eval.json", ".glmq-source-times.json"]
    assert call["ignore_patterns"] == upload.ignore_patterns() + ["glmq_report.json"]  # sent on its own, below
    assert call["repo_type"] == "model"
    # the run report without the uploader's folders (the source's path, here a pytest folder)
    local = json.loads((ckpt / "glmq_report.json").read_text())
    assert report == "upload_file" and sent["path_in_repo"] == "glmq_report.json" and sent["repo_id"] == REPO
    published = json.loads(sent["path_or_fileobj"])
    assert Path(local["source"]).is_absolute() and published["source"] == Path(local["source"]).name
    assert str(Path(local["source"]).parent) not in sent["path_or_fileobj"].decode()
    assert {k: v for k, v in published.items() if k != "source"} == {k: v for k, v in local.items() if k != "source"}
    meta = yaml_block((ckpt / "README.md").read_text())
    assert meta["base_model"] == "zai-org/GLM-5"


def test_upload_large_folder_when_offered_and_not_deprecated(ckpt, hub, monkeypatch):
    monkeypatch.setattr(HfApi, "upload_large_folder", hub.recorder("upload_large_folder", "Upload a large folder."))
    assert run(str(ckpt), "--repo-id", REPO, "--tp", "1").exit_code == 0
    (_, create), (method, call), _ = hub
    assert method == "upload_large_folder" and call["repo_id"] == REPO and call["private"] is None
    assert create["private"] is None  # no --private: the namespace's default visibility
    assert call["ignore_patterns"] == upload.ignore_patterns() + ["glmq_report.json"]


def test_deprecated_upload_large_folder_gives_way_to_upload_folder_with_hf_xet(monkeypatch):
    class Api:
        def upload_large_folder(self):
            """`upload_large_folder` is deprecated: use `upload_folder`."""

    monkeypatch.setattr(upload.importlib.util, "find_spec", lambda name: object())
    assert upload.upload_method(Api(), None) == "upload_folder"
    monkeypatch.setattr(upload.importlib.util, "find_spec", lambda name: None)  # no hf_xet: one-commit upload_folder
    assert upload.upload_method(Api(), "main") == "upload_large_folder"
    assert upload.upload_method(Api(), "dev") == "upload_folder"
    assert upload.upload_method(object(), None) == "upload_folder"  # huggingface_hub without it


def test_revision_creates_the_branch_and_uses_upload_folder(ckpt, hub, monkeypatch):
    monkeypatch.setattr(HfApi, "upload_large_folder", hub.recorder("upload_large_folder", "Upload a large folder."))
    assert run(str(ckpt), "--repo-id", REPO, "--tp", "1", "--revision", "int4-g128").exit_code == 0
    assert [c[0] for c in hub] == ["create_repo", "create_branch", "upload_folder", "upload_file"]
    assert hub[1][1]["branch"] == "int4-g128" and hub[1][1]["exist_ok"] is True
    assert hub[2][1]["revision"] == "int4-g128" and hub[3][1]["revision"] == "int4-g128"
    assert "--revision int4-g128" in (ckpt / "README.md").read_text()


def test_hub_errors_are_one_line_naming_checkpoint_and_fix(ckpt, hub, monkeypatch):
    def refuse(self, *a, **kw):
        resp = httpx.Response(401, request=httpx.Request("POST", "https://huggingface.co/api/repos/create"))
        raise HfHubHTTPError("401 Client Error: Unauthorized\n(Request ID: x)", response=resp)

    monkeypatch.setattr(HfApi, "create_repo", refuse)
    r = run(str(ckpt), "--repo-id", REPO, "--tp", "1")
    assert r.exit_code == 3 and str(ckpt) in r.output and "hf auth login" in r.output and "Traceback" not in r.output
    assert "Request ID" not in r.output  # first line only

    def offline(self, *a, **kw):
        raise httpx.ConnectError("[Errno -3] Temporary failure in name resolution")

    monkeypatch.setattr(HfApi, "create_repo", offline)
    r = run(str(ckpt), "--repo-id", REPO, "--tp", "1")
    assert r.exit_code == 3 and "ConnectError" in r.output and "rerun the same command" in r.output


def test_hub_refusal_says_the_hubs_reason_not_check_the_network(ckpt, hub, monkeypatch):
    """The Hub answers README metadata it rejects (a --base-model it cannot resolve) with a 400 whose reason
    huggingface_hub puts after a line holding only the request id: the error was "(BadRequestError: (Request ID:
    ...)); check the network and rerun the same command", which names neither the cause nor the fix."""
    from huggingface_hub.utils import hf_raise_for_status

    reason = '"base_model" with value "zai-org/GLM-5-FP9" is not valid. Use a model id from https://hf.co/models.'

    def commit(self, *a, **kw):
        request = httpx.Request("POST", f"https://huggingface.co/api/models/{REPO}/commit/main")
        hf_raise_for_status(httpx.Response(400, request=request, headers={"x-request-id": "Root=1-abc"},
                                           json={"error": reason}), endpoint_name="commit")

    monkeypatch.setattr(HfApi, "upload_folder", commit)
    monkeypatch.setattr(HfApi, "upload_large_folder", commit)
    r = run(str(ckpt), "--repo-id", REPO, "--tp", "1", "--base-model", "zai-org/GLM-5-FP9")
    assert r.exit_code == 3 and "Traceback" not in r.output
    last = r.output.strip().splitlines()[-1]
    assert f"(BadRequestError: {reason})" in last and "--base-model" in last, last
    assert "check the network" not in last and "Request ID" not in last


def test_no_token_fails_before_validating(ckpt, hub, monkeypatch):
    monkeypatch.setattr("huggingface_hub.get_token", lambda: None)
    r = run(str(ckpt), "--repo-id", REPO)
    assert r.exit_code == 2 and "no Hugging Face token" in r.output and "hf auth login" in r.output
    assert "glmq validate" not in r.output and hub == []


# ----------------------------------------------------------------------------------------- README and inputs
def test_foreign_readme_is_kept_and_glmq_card_is_replaced(ckpt, hub):
    (ckpt / "README.md").write_text("# my own card\n")
    r = run(str(ckpt), "--repo-id", REPO, "--tp", "1")
    assert r.exit_code == 0 and "keeping" in r.output
    assert (ckpt / "README.md").read_text() == "# my own card\n"
    (ckpt / "README.md").unlink()
    assert run(str(ckpt), "--repo-id", REPO, "--tp", "1").exit_code == 0
    assert "--tp 1\n" in (ckpt / "README.md").read_text()
    assert run(str(ckpt), "--repo-id", REPO, "--tp", "1", "--license", "mit").exit_code == 0  # ours: rewritten
    assert yaml_block((ckpt / "README.md").read_text())["license"] == "mit"


def test_no_card_writes_no_readme(ckpt, hub):
    assert run(str(ckpt), "--repo-id", REPO, "--tp", "1", "--no-card").exit_code == 0
    assert not (ckpt / "README.md").exists() and [c[0] for c in hub][0] == "create_repo"


def test_card_options_without_a_card_are_refused_or_warned(ckpt, hub):
    """--license and --base-model only fill the card: with --no-card they were dropped unsaid (exit 0)."""
    r = run(str(ckpt), "--repo-id", REPO, "--tp", "1", "--dry-run", "--no-card", "--license", "mit",
            "--base-model", "a/b")
    assert r.exit_code == 2 and "--license and --base-model go into the model card's metadata only" in r.output
    r = run(str(ckpt), "--repo-id", REPO, "--tp", "1", "--dry-run", "--no-card", "--license", "mit")
    assert r.exit_code == 2 and "--license goes into the model card's metadata only" in r.output
    assert not hub
    (ckpt / "README.md").write_text("# my own card\n")
    r = run(str(ckpt), "--repo-id", REPO, "--tp", "1", "--dry-run", "--license", "mit")
    assert r.exit_code == 0 and "; --license reaches the Hub only through that card" in r.output, r.output


def test_eval_report_from_the_folder_or_the_option(ckpt, hub, tmp_path):
    (ckpt / "glmq_eval.json").write_text(json.dumps(EVAL))
    r = run(str(ckpt), "--repo-id", REPO, "--tp", "1", "--dry-run")
    assert r.exit_code == 0 and "| **this checkpoint** (`ckpt`) | 3.9342 |" in r.stdout
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"models": [{"checkpoint": "x"}]}))
    r = run(str(ckpt), "--repo-id", REPO, "--tp", "1", "--eval-report", str(bad), "--dry-run")
    assert r.exit_code == 2 and str(bad) in r.output and "glmq eval --json" in r.output
    # a report of other checkpoints: given, refused; found in the folder, left out of the card with a warning
    other = {**EVAL, "models": [EVAL["models"][0]] + [{**m, "checkpoint": f"/x/other-{i}"}
                                                      for i, m in enumerate(EVAL["models"][1:])]}
    (tmp_path / "other.json").write_text(json.dumps(other))
    r = run(str(ckpt), "--repo-id", REPO, "--tp", "1", "--eval-report", str(tmp_path / "other.json"), "--dry-run")
    assert r.exit_code == 2 and "not this checkpoint (ckpt)" in r.output
    (ckpt / "glmq_eval.json").write_text(json.dumps(other))
    r = run(str(ckpt), "--repo-id", REPO, "--tp", "1", "--dry-run")
    assert r.exit_code == 0 and "not this checkpoint (ckpt)" in r.output and "## Evaluation" not in r.stdout


def test_eval_report_of_dot_in_the_folder_is_this_checkpoint_and_is_not_published(ckpt, hub):
    """`glmq eval SOURCE . --json glmq_eval.json`, run in the checkpoint folder, records the checkpoint as ".", whose
    name is "": the card dropped the evaluation, warning that the report "evaluates no quantized model". And the
    report itself was uploaded, with the local paths of the source, the checkpoints and the text in it."""
    dot = {**EVAL, "models": [EVAL["models"][0], {**EVAL["models"][1], "checkpoint": "."}]}
    (ckpt / "glmq_eval.json").write_text(json.dumps(dot))
    r = run(str(ckpt), "--repo-id", REPO, "--tp", "1", "--dry-run")
    assert r.exit_code == 0 and "not this checkpoint" not in r.output, r.output
    assert "| **this checkpoint** (`ckpt`) | 3.9342 | 0.01234 |" in r.stdout
    assert "glmq_eval.json" not in listing(r.stdout) and "skipped  glmq_eval.json" in r.stdout
    assert "/data/prose.txt" not in r.stdout  # the card names the text file only
    assert run(str(ckpt), "--repo-id", REPO, "--tp", "1").exit_code == 0
    assert "glmq_eval.json" in hub[-2][1]["ignore_patterns"] and "glmq_eval.json" not in upload.split_files(ckpt)[0]


def test_missing_folder_not_a_checkpoint_and_bad_ids(ckpt, hub, tmp_path):
    r = run(str(tmp_path / "nope"), "--repo-id", REPO)
    assert r.exit_code == 2 and "nope: no such folder" in r.output
    for flag, bad in (("--repo-id", "just-a-name"), ("--base-model", "/models/GLM-5")):
        args = ["--repo-id", REPO, flag, bad] if flag != "--repo-id" else ["--repo-id", bad]
        r = run(str(ckpt), *args)
        assert r.exit_code == 2 and f"{flag} {bad!r}: not a Hub model id" in r.output
    (ckpt / "config.json").unlink()
    r = run(str(ckpt), "--repo-id", REPO)
    assert r.exit_code == 2 and f"{ckpt}: no config.json" in r.output
    assert hub == [] and "Traceback" not in r.output


def test_without_manifest_uploads_with_a_warning(ckpt, hub):
    (ckpt / "glmq_manifest.json").unlink()
    r = run(str(ckpt), "--repo-id", REPO, "--tp", "1")
    assert r.exit_code == 0, r.output
    assert "has no glmq_manifest.json" in r.output
    card = (ckpt / "README.md").read_text()
    assert "no checksums to check" in card and "| integrity | skip |" in card
    assert "name: int4-w4a16" in card  # the recipe still comes from glmq_report.json


def test_an_eval_report_inside_the_folder_under_another_name_stays_local(ckpt, hub):
    """`--eval-report ckpt/eval-results.json` built the card and was uploaded too, with the local paths of the source,
    the checkpoints and the text in it; only the default name glmq_eval.json was kept back."""
    row = {**EVAL["models"][1], "checkpoint": str(ckpt)}
    (ckpt / "sub").mkdir()
    for name in ("eval-results.json", "sub/e[1].json"):  # a name with fnmatch's brackets matches only itself
        (ckpt / name).write_text(json.dumps({**EVAL, "models": [EVAL["models"][0], row]}))
    (ckpt / "sub" / "e1.json").write_text("{}")  # what glob.escape keeps the pattern from matching
    for name in ("eval-results.json", "sub/e[1].json"):
        r = run(str(ckpt), "--repo-id", REPO, "--tp", "1", "--eval-report", str(ckpt / name), "--dry-run")
        assert r.exit_code == 0 and "| **this checkpoint** (`ckpt`) | 3.9342 |" in r.stdout, r.output
        assert name not in listing(r.stdout) and f"skipped  {name}" in r.stdout
        assert "sub/e1.json" in listing(r.stdout)
    hub.clear()
    r = run(str(ckpt), "--repo-id", REPO, "--tp", "1", "--eval-report", str(ckpt / "eval-results.json"))
    assert r.exit_code == 0, r.output
    patterns = next(c for n, c in hub if n.startswith("upload_") and n != "upload_file")["ignore_patterns"]
    assert "eval-results.json" in patterns
    # a report outside the folder adds no pattern, unless a link in the folder leads to it
    (ckpt / "eval-results.json").unlink()
    (ckpt / "sub" / "e[1].json").unlink()
    outside = ckpt.parent / "e.json"
    outside.write_text("{}")
    assert upload.local_patterns(ckpt, outside) == [] and upload.local_patterns(ckpt, None) == []
    (ckpt / "eval-link.json").symlink_to(outside)
    assert upload.local_patterns(ckpt, outside) == ["eval-link.json"]
    assert "eval-link.json" not in upload.split_files(ckpt, upload.local_patterns(ckpt, outside))[0]


def test_repo_ids_the_hub_refuses_are_refused_before_validating(ckpt, hub):
    """'me/tiny-', 'me/tiny.git', non-ASCII letters and a trailing newline passed glmq's own pattern: the dry run said
    OK, and a real upload validated, wrote README.md and then failed with "check the network and rerun" (exit 3)."""
    for bad in ("me/tiny-", "me/tiny.", "me/tiny.git", "me/t\u00efny", "me/tiny\n", "me/-tiny", "me//tiny"):
        r = run(str(ckpt), "--repo-id", bad, "--tp", "1", "--dry-run")
        assert r.exit_code == 2 and f"--repo-id {bad!r}: not a Hub model id" in r.output, (bad, r.output)
        assert "glmq validate" not in r.output
    assert not (ckpt / "README.md").exists() and hub == []
    for good in ("me/tiny", "zai-org/GLM-5.2-FP8", "moonshotai/Kimi-K2-Instruct", "a/b_c.d-e"):
        assert mc.is_repo_id(good), good


def test_arguments_huggingface_hub_refuses_are_not_blamed_on_the_network(ckpt, hub, monkeypatch):
    from huggingface_hub.errors import HFValidationError

    def refuse(self, *a, **kw):
        raise HFValidationError("Repo id must use alphanumeric chars")

    monkeypatch.setattr(HfApi, "create_repo", refuse)
    r = run(str(ckpt), "--repo-id", REPO, "--tp", "1")
    assert r.exit_code == 3 and "refused the arguments before sending anything" in r.output
    assert "check the network" not in r.output


def test_the_published_report_cuts_a_relative_source_and_calibration_path(tmp_path):
    """A relative --model (`private/acme/GLM-5-FP8`) and --calibration (`data/secret/calib.txt`) were published as
    typed: only strings starting with /, ~, ./ or ../ were cut to their names."""
    description = "experts INT4 w/ g128/sym, rest BF16; see https://github.com/acme/glmq-recipes"
    report = {"source": "private/acme/GLM-5-FP8", "family": "glm_moe_dsa",
              "gptq": {"settings": {"calibration": "data/secret/calib.txt", "offload_activations": "scratch/acts"}},
              "recipe": {"name": "int4-w4a16", "description": description}}
    (tmp_path / "glmq_report.json").write_text(json.dumps(report))
    published = json.loads(upload.public_report(tmp_path / "glmq_report.json"))
    assert published["source"] == "GLM-5-FP8"
    assert published["gptq"]["settings"] == {"calibration": "calib.txt", "offload_activations": "acts"}
    # free text is not a path: the recipe's description (a URL in it) is published as the card shows it
    assert published["family"] == "glm_moe_dsa" and published["recipe"] == report["recipe"]
    for source, shown in ((".", "."), ("/data/ckpt/GLM-5-FP8", "GLM-5-FP8"), ("GLM-5-FP8", "GLM-5-FP8")):
        (tmp_path / "glmq_report.json").write_text(json.dumps({**report, "source": source}))
        assert json.loads(upload.public_report(tmp_path / "glmq_report.json"))["source"] == shown
    report["gptq"]["settings"]["calibration"] = "allenai/c4"  # a Hub dataset id stays
    (tmp_path / "glmq_report.json").write_text(json.dumps(report))
    assert json.loads(upload.public_report(tmp_path / "glmq_report.json"))["gptq"]["settings"]["calibration"] == \
        "allenai/c4"


def test_an_eval_report_with_figures_that_are_not_finite_makes_no_card(ckpt, hub, tmp_path):
    """This checkpoint's or the source's figures not finite: refused. Another model's (a broken RTN sibling evaluated
    in the same run): shown as "-". A default report about other models: still a warning, not an error."""
    this = {**EVAL["models"][1], "checkpoint": str(ckpt)}
    for value in (None, float("nan"), float("inf")):  # glmq eval writes null; an older report NaN or Infinity
        for rows in ([EVAL["models"][0], {**this, "perplexity": value}],
                     [{**EVAL["models"][0], "kl_to_source": value}, this]):
            (tmp_path / "e.json").write_text(json.dumps({**EVAL, "models": rows}))
            r = run(str(ckpt), "--repo-id", REPO, "--tp", "1", "--eval-report", str(tmp_path / "e.json"), "--dry-run")
            assert r.exit_code == 2 and "are not finite numbers" in r.output, (value, r.output)
            assert str(rows[0 if rows[1] is this else 1]["checkpoint"]) in r.output
    sibling = {**EVAL["models"][1], "checkpoint": "/out/ckpt-rtn", "perplexity": None, "layer_rel_error": [None]}
    (tmp_path / "e.json").write_text(json.dumps({**EVAL, "models": [EVAL["models"][0], sibling, this]}))
    r = run(str(ckpt), "--repo-id", REPO, "--tp", "1", "--eval-report", str(tmp_path / "e.json"), "--dry-run")
    assert r.exit_code == 0, r.output
    assert "| ckpt-rtn (`ckpt-rtn`) | - | 0.01234 | - |" in r.stdout and "| **this checkpoint** (`ckpt`) | 3.9342 |" in r.stdout
    (ckpt / "glmq_eval.json").write_text(json.dumps({**EVAL, "models": [EVAL["models"][0], sibling]}))
    r = run(str(ckpt), "--repo-id", REPO, "--tp", "1", "--dry-run")
    assert r.exit_code == 0 and "not this checkpoint (ckpt)" in r.output, r.output


def test_the_tp_hint_only_when_serving_is_the_one_failed_check(ckpt, hub, make_ckpt):
    """An FP8 source fails structure and config as well: the refusal led with "If you serve it at another
    tensor-parallel degree, pass --tp N", which cannot help."""
    r = run(str(make_ckpt("glm_moe_dsa", "fp8-block")), "--repo-id", REPO, "--tp", "1", "--dry-run")
    assert r.exit_code == 1 and "another tensor-parallel degree" not in r.output, r.output
    r = run(str(ckpt), "--repo-id", REPO, "--tp", "64", "--dry-run")
    assert r.exit_code == 1 and "(failed checks: serving;" in r.output and "another tensor-parallel degree" in r.output


def test_a_folder_without_a_tokenizer_is_uploaded_with_a_loud_warning(ckpt, hub):
    """The card's `vllm serve` commands load the tokenizer from the repo: a folder without one passed as VALID with no
    word about it."""
    from glmq.formats import fixtures

    r = run(str(ckpt), "--repo-id", REPO, "--tp", "1", "--dry-run")
    assert r.exit_code == 0 and "no tokenizer file among the files to upload" in r.output
    fixtures.write_byte_tokenizer(ckpt)
    r = run(str(ckpt), "--repo-id", REPO, "--tp", "1", "--dry-run")
    assert r.exit_code == 0 and "no tokenizer" not in r.output and "tokenizer.json" in listing(r.stdout)


def test_an_eval_report_of_another_checkpoint_of_the_same_name_is_not_this_ones(ckpt, hub, tmp_path):
    """The card matched the report's rows to the folder by its name alone: an evaluation of another folder named
    `ckpt` (another recipe, or this folder before it was quantized again) was shown as "this checkpoint". glmq eval
    records each model's fingerprint; upload uses the row whose fingerprint is this folder's."""
    mine = fingerprint(ckpt)
    other = {**EVAL["models"][1], "perplexity": 9.5, "fingerprint": "0" * 64}
    rows = [{**EVAL["models"][0], "fingerprint": "1" * 64}, other]
    (tmp_path / "other.json").write_text(json.dumps({**EVAL, "models": rows}))
    r = run(str(ckpt), "--repo-id", REPO, "--tp", "1", "--eval-report", str(tmp_path / "other.json"), "--dry-run")
    assert r.exit_code == 2 and "evaluates another checkpoint named ckpt (its tensors differ" in r.output, r.output
    assert hub == []
    (ckpt / "glmq_eval.json").write_text(json.dumps({**EVAL, "models": rows}))
    r = run(str(ckpt), "--repo-id", REPO, "--tp", "1", "--dry-run")
    assert r.exit_code == 0 and "another checkpoint named ckpt" in r.output and "## Evaluation" not in r.stdout
    # both in one report: the one whose weights are these is "this checkpoint", the other is shown by name
    rows.append({**EVAL["models"][1], "fingerprint": mine})
    (ckpt / "glmq_eval.json").write_text(json.dumps({**EVAL, "models": rows}))
    r = run(str(ckpt), "--repo-id", REPO, "--tp", "1", "--dry-run")
    assert r.exit_code == 0 and "another checkpoint" not in r.output and "no fingerprint" not in r.output, r.output
    assert "| **this checkpoint** (`ckpt`) | 3.9342 |" in r.stdout and "| ckpt (`ckpt`) | 9.5000 |" in r.stdout
    # quantized again (a tensor's checksum changes): the report no longer fits
    man = json.loads((ckpt / "glmq_manifest.json").read_text())
    rec = next(iter(man["files"].values()))
    name = next(iter(rec["tensors"]))
    rec["tensors"][name] = "f" * 64
    (ckpt / "glmq_manifest.json").write_text(json.dumps(man))
    assert fingerprint(ckpt) != mine
    assert upload.read_eval(ckpt, None) is None
    # a report of an older glmq eval (no fingerprint) is used by name, with a warning
    (ckpt / "glmq_eval.json").write_text(json.dumps(EVAL))
    r = run(str(ckpt), "--repo-id", REPO, "--tp", "1", "--dry-run", "--no-card")
    assert r.exit_code == 0 and "recorded no fingerprint" in r.output, r.output


def test_glmq_reports_anywhere_in_the_folder_stay_local(ckpt, hub, tmp_path):
    """Only glmq_eval.json at the top was kept back: an eval report in a sub-folder, a validate report or a copy of
    the run report (`--json` of eval, validate, quantize: any name) was published with the local paths in it. Each
    is told by its keys; other JSON files (and the top-level run report, published with its paths cut) go up."""
    (ckpt / "evals").mkdir()
    (ckpt / "evals" / "glmq_eval.json").write_text(json.dumps(EVAL))
    assert CliRunner().invoke(main, ["validate", str(ckpt), "--json", str(ckpt / "ci-validate.json")]).exit_code == 0
    shutil.copy(ckpt / "glmq_report.json", ckpt / "evals" / "run.json")
    (ckpt / "evals" / "notes.json").write_text(json.dumps({"models": ["a"], "checks": 1}))
    r = run(str(ckpt), "--repo-id", REPO, "--tp", "1", "--dry-run")
    assert r.exit_code == 0, r.output
    sent = listing(r.stdout)
    for name in ("evals/glmq_eval.json", "ci-validate.json", "evals/run.json"):
        assert name not in sent and f"skipped  {name}" in r.stdout
    assert {"evals/notes.json", "glmq_report.json", "config.json"} <= sent.keys()
    assert [upload.glmq_report_kind(ckpt / n) for n in ("evals/glmq_eval.json", "ci-validate.json", "evals/run.json",
                                                        "evals/notes.json", "config.json")] == \
        ["eval", "validate", "run", None, None]
    assert run(str(ckpt), "--repo-id", REPO, "--tp", "1").exit_code == 0
    patterns = next(c for n, c in hub if n.startswith("upload_") and n != "upload_file")["ignore_patterns"]
    assert {"evals/glmq_eval.json", "ci-validate.json", "evals/run.json"} <= set(patterns)


def test_a_gptq_card_says_what_was_not_gptq(written):
    """The card of a GPTQ run said "method GPTQ" and tabled GPTQ's tensors only: the MTP layer's experts (48 of 192
    in the helper's run) were round-to-nearest, which only the run report said; nor were fallbacks or experts no token
    reached mentioned."""
    from glmq.calibration.engine import CalibrationSettings

    report = json.loads((written / "glmq_report.json").read_text())
    report["recipe"]["method"] = "gptq"
    report["gptq"] = {"settings": CalibrationSettings(calibration="c.txt").identity(), "calibration_tokens": 256,
                      "by_class": {"routed_expert": {"tensors": 48, "rel_err_gptq": 0.03, "rel_err_rtn": 0.1}},
                      "mtp": {"layers": [3], "tensors": 24, "method": "rtn", "why": "no calibration inputs"},
                      "fallbacks": [{"module": "model.layers.1.mlp.experts.2.up_proj", "reason": "no usable damp"}],
                      "expert_coverage": {"unreached": [{"layer": 1, "expert": 0}],
                                          "under_covered": [{"layer": 1, "expert": 0, "hessian": "all_tokens"}]}}
    card = str(mc.build_card(card_inputs(written, report=report)))
    assert "- MTP layer(s) [3]: 24 quantized tensors are round-to-nearest, not GPTQ (no calibration inputs)." in card
    assert "- 1 tensor(s) fell back to round-to-nearest (e.g. `model.layers.1.mlp.experts.2.up_proj`: no usable " \
           "damp)." in card
    assert "- 1 routed expert(s) received no calibration token: GPTQ on the Hessian of every token of their layer." \
        in card
    report["gptq"].update(mtp={"layers": [], "tensors": 0}, fallbacks=[], expert_coverage={"unreached": []})
    card = str(mc.build_card(card_inputs(written, report=report)))
    assert "MTP layer(s)" not in card and "fell back" not in card and "no calibration token" not in card


def test_a_license_that_is_no_hub_id_and_a_long_repo_id_are_refused_with_the_reason(ckpt, hub):
    """--license "not a license!" passed the dry run into the card's metadata (the Hub refuses it, after README.md was
    written); a repo id over the Hub's 96 characters was refused without saying that length was the reason."""
    r = run(str(ckpt), "--repo-id", REPO, "--license", "not a license!", "--dry-run")
    assert r.exit_code == 2 and "--license 'not a license!': not a Hub license id" in r.output and hub == []
    assert not (ckpt / "README.md").exists()
    long_id = "org/" + "m" * 100
    r = run(str(ckpt), "--repo-id", long_id, "--dry-run")
    assert r.exit_code == 2 and "at most 96 characters each side of the '/', this one has 100" in r.output
    assert run(str(ckpt), "--repo-id", "o/" + "m" * 96, "--tp", "1", "--dry-run").exit_code == 0  # 98 in all: taken
    r = run(str(ckpt), "--repo-id", REPO, "--tp", "1", "--license", "apache-2.0", "--dry-run")
    assert r.exit_code == 0 and "license: apache-2.0" in r.stdout


@pytest.mark.parametrize("branch", ["", "my branch", "a/..x", "x.lock", "-x"])
def test_a_revision_that_is_no_branch_name_is_refused_before_anything_is_written(ckpt, hub, branch):
    """--revision "" was listed as main, then sent to the Hub as an empty branch (create_branch(branch="")), after
    README.md was written; names git refuses went the same way."""
    r = run(str(ckpt), "--repo-id", REPO, "--tp", "1", "--revision", branch)
    assert r.exit_code == 2 and f"--revision {branch!r}: not a branch name" in r.output
    assert hub == [] and not (ckpt / "README.md").exists()


def test_a_renamed_checkpoint_keeps_its_evaluation_by_fingerprint(ckpt, hub, tmp_path):
    """The README says the evaluation is used when the report evaluated this folder's tensors; the rows were matched by
    folder name first, so a renamed (or copied) checkpoint lost its evaluation with identical tensors."""
    rows = [{**EVAL["models"][0], "fingerprint": "1" * 64},
            {**EVAL["models"][1], "checkpoint": "/out/old-name", "fingerprint": fingerprint(ckpt)}]
    (tmp_path / "e.json").write_text(json.dumps({**EVAL, "models": rows}))
    r = run(str(ckpt), "--repo-id", REPO, "--tp", "1", "--eval-report", str(tmp_path / "e.json"), "--dry-run")
    assert r.exit_code == 0 and "| **this checkpoint** (`old-name`) | 3.9342 |" in r.stdout, r.output
    rows[1]["fingerprint"] = "0" * 64  # another model's tensors, under another name: still refused
    (tmp_path / "e.json").write_text(json.dumps({**EVAL, "models": rows}))
    r = run(str(ckpt), "--repo-id", REPO, "--tp", "1", "--eval-report", str(tmp_path / "e.json"), "--dry-run")
    assert r.exit_code == 2 and "evaluates old-name, not this checkpoint (ckpt)" in r.output


def test_a_card_that_cannot_be_written_stops_before_anything_is_sent(ckpt, hub, monkeypatch):
    """A full disk (or a read-only folder) at README.md: a traceback before; now exit 2 naming the file, and no call
    reaches the Hub."""
    from glmq.formats import safetensors_io

    def full(path, text):
        raise OSError(28, "No space left on device", str(path))

    monkeypatch.setattr(safetensors_io, "atomic_write_text", full)
    r = run(str(ckpt), "--repo-id", REPO, "--tp", "1")
    assert r.exit_code == 2 and f"{ckpt / 'README.md'}: the model card could not be written (No space left on " \
        "device); free space or make the folder writable, or pass --no-card" in r.output, r.output
    assert not [name for name, _ in hub if name != "_validate_yaml"]
