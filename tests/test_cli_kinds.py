"""Every CLI command that takes a bundle or a source, on one model of each kind, through the real CLI.

Each answer is exit 0 with a summary saying what was done, or exit 1 with one `error: ...` line that says the
command does not take that kind and what to use instead: never a traceback. (The decoder's `kvforge serve`
runs a server until a signal: tests/serving/test_triton.py drives it.)
"""

from __future__ import annotations

import re

import pytest
from click.testing import CliRunner

from kvforge.cli import main

KINDS = {"decoder": "gpt2-micro", "encoder": "bert-micro", "encoder-decoder": "t5-micro", "perceiver": "perceiver-micro",
         "vision-language": "llava-micro"}
REFUSE_GENERATE = r"does not generate text; use embed\(\) or classify\(\)"
REFUSE_EMBED = r"`kvforge embed` runs encoder bundles .*use `kvforge generate`"
REFUSE_BENCH = r"`kvforge bench` measures a decoder LM's prefill and decode"
REFUSE_CHAT = r"`kvforge chat` talks with a decoder LM"

# command -> (argv after the command, given the bundle and a scratch directory; kind -> None (ok) or a refusal)
COMMANDS = {
    "inspect": (lambda b, w: [b], {}),
    "lint": (lambda b, w: [b], {}),
    "calibrate": (lambda b, w: [b, "-o", w / "q", "--precision", "int8", "--random-data", "--samples", "4", "--seq-len", "32",
                                "--quiet"], {}),
    "compare": (lambda b, w: [b, "--random-data", "--steps", "2", "--prompts", "1", "--quiet"], {}),
    "generate": (lambda b, w: [b, "--prompt", "hello", "--max-new-tokens", "3"], {"encoder": REFUSE_GENERATE, "perceiver": REFUSE_GENERATE}),
    # the micro decoders have no chat template: tests/test_chat.py runs a chat on a checkpoint that has one
    # (a vision-language bundle chats in text, images through `kvforge generate --chat --image` and the server)
    "chat": (lambda b, w: [b, "--max-new-tokens", "2"], {"decoder": r"has no chat template",
                                                         "vision-language": r"has no chat template",
                                                         **{k: REFUSE_CHAT for k in ("encoder", "encoder-decoder",
                                                                                     "perceiver")}}),
    "embed": (lambda b, w: [b, "--text", "hello"], {k: REFUSE_EMBED for k in ("decoder", "encoder-decoder", "vision-language")}),
    "bench": (lambda b, w: [b, "--runs", "1", "--warmup", "0", "--prompt-len", "4", "--new-tokens", "2"],
              {k: REFUSE_BENCH for k in ("encoder", "encoder-decoder", "perceiver", "vision-language")}),
    "build": (lambda b, w: [b, "--dry-run"], {}),
    "triton": (lambda b, w: [b, "-o", w / "repo", "--prefill-chunk", "64", "--mixed-steps"], {}),
    # every kind is served (serving/kinds.py): a server runs until a signal, tests/serving/test_triton.py runs them
    "serve": (lambda b, w: [b, "--http-port", "0", "--grpc-port", "0", "--metrics-port", "0"], {}),
}
SUMMARY = {"inspect": r"files: intact", "lint": r"passed|lint", "calibrate": r"wrote .*int8", "compare": r"pass",
           "generate": r"\S", "embed": r"'hello': dim \d+", "bench": r"decode [\d.]+ tok/s", "build": r"build plan for",
           "triton": r"wrote .*: model"}


def _run(argv):
    result = CliRunner().invoke(main, [str(a) for a in argv])
    assert result.exception is None or isinstance(result.exception, SystemExit), repr(result.exception)
    assert "Traceback" not in result.output, result.output
    return result


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """Factory: kind -> (the answer of `kvforge export` on its micro preset, the bundle it wrote), run once per kind
    for the module: the commands below take that bundle (tests only read it)."""
    made = {}

    def make(kind):
        if kind not in made:
            out = tmp_path_factory.mktemp(f"cli-{kind}") / "b"
            made[kind] = (_run(["export", KINDS[kind], "-o", out, "--quiet"]), out)
        return made[kind]

    return make


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_export_writes_and_summarizes_every_kind(kind, exported):
    result, _ = exported(kind)
    assert result.exit_code == 0, result.output
    assert re.search(rf"wrote .*\({kind}\): float32, opset \d+; validation passed vs torch float(32|64)[^;]* over \d+ shapes; .*max abs", result.output)


@pytest.mark.parametrize("command", sorted(COMMANDS))
@pytest.mark.parametrize("kind", sorted(KINDS))
def test_each_command_on_each_kind_answers_or_refuses_clearly(command, kind, exported, tmp_path):
    args, refusals = COMMANDS[command]
    if command == "serve" and kind not in refusals:
        pytest.skip("a server runs until a signal: tests/serving/test_triton.py")
    if command == "serve":
        from kvforge.errors import MissingDependencyError
        from kvforge.serving import triton_distribution

        try:
            triton_distribution()
        except MissingDependencyError as e:
            pytest.skip(f"needs the serve extra: {e}")
    written, bundle = exported(kind)
    assert written.exit_code == 0, written.output
    result = _run([command, *args(bundle, tmp_path)])
    if kind in refusals:
        errors = [line for line in result.output.splitlines() if line.startswith("error: ")]
        assert result.exit_code == 1 and len(errors) == 1 and re.search(refusals[kind], errors[0]), result.output
    else:
        assert result.exit_code == 0, result.output
        assert re.search(SUMMARY[command], result.output), result.output
        if command == "triton":  # the batching flags reach the model's configuration
            config = next((tmp_path / "repo").glob("*/config.pbtxt")).read_text()
            assert 'key: "prefill_chunk" value: { string_value: "64" }' in config
            assert 'key: "mixed_steps" value: { string_value: "True" }' in config


@pytest.mark.parametrize("kind", sorted(k for k in KINDS if k not in COMMANDS["compare"][1]))  # check compares
def test_check_runs_every_kind_against_its_baseline(kind, exported, tmp_path):
    """The baseline is written from the bundle `kvforge export` wrote (an artifact given as a bundle); the check
    then exports the source itself and compares with it."""
    data = '[data]\nrandom = true\nsteps = 2\nprompts = 1\n\n'
    given = tmp_path / "given.toml"
    given.write_text(f'source = "{KINDS[kind]}"\nbaseline = "spec.baseline.json"\n\n{data}'
                     f'[[artifacts]]\nname = "fp32"\nbundle = "{exported(kind)[1]}"\n')
    spec = tmp_path / "spec.toml"
    spec.write_text(f'source = "{KINDS[kind]}"\nbaseline = "spec.baseline.json"\n\n{data}'
                    '[[artifacts]]\nname = "fp32"\ndtype = "float32"\n')
    written = _run(["check", given, "--update-baseline", "--quiet"])
    assert written.exit_code == 0 and (tmp_path / "spec.baseline.json").is_file(), written.output
    checked = _run(["check", spec, "--quiet"])
    assert checked.exit_code == 0 and "check passed" in checked.output, checked.output
