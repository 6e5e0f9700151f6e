"""Nothing of the user's is lost: every config file a command writes is merged into the one that
is there, and one path named for two outputs is refused before anything is written."""

from __future__ import annotations

import itertools
import json

import pytest
from typer.testing import CliRunner

from autobatch.cli import app

KEYS = {"learning_rate": 0.0003, "output_dir": "runs/x"}


def invoke(*args: str):
    return CliRunner().invoke(app, list(args))


@pytest.mark.parametrize("command", [
    ["solve", "--target", "16"],
    ["find", "--model", "tiny-mlp", "--device", "cpu", "--memory", "2MiB", "--target", "16", "--max-micro", "16"],
    ["estimate", "--model", "tiny-mlp", "--gpu", "t4", "--target", "16"],
], ids=["solve", "find", "estimate"])
@pytest.mark.parametrize("flag, name", [("--hf", "hf.json"), ("--hf", "hf.yaml"), ("--deepspeed", "ds.json"),
                                        ("--accelerate", "acc.json")])
def test_an_existing_config_keeps_every_key_the_plan_does_not_decide(command, flag, name, tmp_path):
    path = tmp_path / name
    path.write_text(json.dumps(KEYS))  # JSON is YAML too
    result = invoke(*command, flag, str(path))
    assert result.exit_code == 0, result.output
    from autobatch.configs.files import read_config

    kept = read_config(path)
    assert {k: kept[k] for k in KEYS} == KEYS, kept
    assert f"updated {path}" in result.stdout and "kept 2 keys as they were" in result.stdout


OUTPUTS = [("--deepspeed", ".json"), ("--accelerate", ".json"), ("--hf", ".json")]


@pytest.mark.parametrize("first, second", list(itertools.combinations(OUTPUTS, 2)),
                         ids=lambda pair: pair[0].strip("-"))
def test_one_path_for_two_outputs_is_refused_and_the_file_untouched(first, second, tmp_path):
    same = tmp_path / "same.json"
    same.write_text(json.dumps({"train_batch_size": 8, "zero_optimization": {"stage": 2}}))
    before = same.read_text()
    result = invoke("solve", "--target", "16", first[0], str(same), second[0], str(same))
    assert result.exit_code == 2
    assert f"{first[0]} and {second[0]} name the same file" in result.stderr
    assert same.read_text() == before


@pytest.mark.parametrize("command", [
    ["solve", "--target", "16"],
    ["estimate", "--model", "tiny-mlp", "--gpu", "t4", "--target", "16"],
], ids=["solve", "estimate"])
@pytest.mark.parametrize("bad", ["--deepspeed", "--accelerate", "--hf"])
def test_an_output_that_cannot_be_written_is_refused_before_any_file_is(command, bad, tmp_path):
    """Every output's folder is tried before the first write: one that cannot take the file (here its
    folder is a file) leaves the others as they were, none made and none merged half way."""
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    existing = {"train_batch_size": 8, "zero_optimization": {"stage": 1}}
    args, kept = [], {}
    for flag, _ in OUTPUTS:
        path = blocker / "x.json" if flag == bad else tmp_path / f"{flag.strip('-')}.json"
        if flag != bad:
            path.write_text(json.dumps(existing))
            kept[path] = path.read_text()
        args += [flag, str(path)]
    result = invoke(*command, *args)
    assert result.exit_code == 2, result.output
    assert f"for {bad} must be writable" in result.stderr and "Traceback" not in result.output
    assert all(path.read_text() == text for path, text in kept.items())
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["a-file", *(p.name for p in kept)])


def test_a_write_that_fails_half_way_names_the_files_already_written(tmp_path):
    from autobatch.configs import write_plan_configs
    from autobatch.configs.files import ConfigFileError
    from autobatch.planning.solver import solve

    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    with pytest.raises(ConfigFileError, match=r"already written from this plan: .*ds\.json"):
        write_plan_configs(solve(16, 2, 1, max_micro=4), deepspeed=tmp_path / "ds.json", hf=blocker / "hf.json")


@pytest.mark.parametrize("strategy", ["fsdp2", "fsdp1"])
def test_solve_wraps_fsdp_one_way_in_every_file_and_line_and_says_how(strategy, tmp_path):
    """solve knows no model: with no --fsdp-unit the files wrap by size, and so does the Lightning line (it said
    "each block" beside files that wrap by size), and a note says how to wrap each block; a named block is
    wrapped in every output alike."""
    from autobatch.configs.files import read_config

    common = ["solve", "--target", "64", "--gpus", "4", "--max-micro", "8", "--strategy", strategy]
    by_size = invoke(*common, "--accelerate", str(tmp_path / "a.yaml"), "--hf", str(tmp_path / "h.json"))
    assert by_size.exit_code == 0, by_size.output
    assert read_config(tmp_path / "a.yaml")["fsdp_config"]["fsdp_auto_wrap_policy"] == "SIZE_BASED_WRAP"
    assert read_config(tmp_path / "h.json")["fsdp_config"]["min_num_params"] == 100_000_000
    assert "each block" not in by_size.stdout
    if strategy == "fsdp2":
        assert "fully_shard(each submodule of at least 100,000,000 parameters" in by_size.stdout
    assert f"note: {strategy} with no --fsdp-unit: solve knows no model" in by_size.stderr

    named = invoke(*common, "--fsdp-unit", "LlamaDecoderLayer", "--accelerate", str(tmp_path / "b.yaml"))
    assert named.exit_code == 0 and "note:" not in named.stderr, named.output
    fsdp = read_config(tmp_path / "b.yaml")["fsdp_config"]
    assert (fsdp["fsdp_auto_wrap_policy"], fsdp["fsdp_transformer_layer_cls_to_wrap"]) == (
        "TRANSFORMER_BASED_WRAP", "LlamaDecoderLayer")
    if strategy == "fsdp2":
        assert "fully_shard(each LlamaDecoderLayer" in named.stdout


# --- a file's comments: a rewrite keeps none, so the file as it was is kept beside it ----------


def test_a_commented_file_merged_into_is_kept_as_it_was_beside_it(tmp_path):
    from tests.extras import need

    need("hjson")
    ds, acc = tmp_path / "ds.json", tmp_path / "acc.yaml"
    ds_text = '{\n  // our cluster\'s bucket, tuned by hand\n  "gradient_clipping": 1.0,\n  "train_batch_size": 64\n}\n'
    acc_text = "# shared by the team: do not edit num_machines\nnum_machines: 1\nmixed_precision: bf16\n"
    ds.write_text(ds_text)
    acc.write_text(acc_text)
    taken = tmp_path / "acc.yaml.orig"
    taken.write_text("an older copy of something else\n")
    result = CliRunner().invoke(app, ["solve", "--target", "256", "--gpus", "8", "--max-micro", "16",
                                      "--deepspeed", str(ds), "--accelerate", str(acc)])
    assert result.exit_code == 0, result.output
    assert (tmp_path / "ds.json.orig").read_text() == ds_text  # the comment survives, byte for byte
    assert (tmp_path / "acc.yaml.orig.1").read_text() == acc_text and taken.read_text().startswith("an older")
    assert f"its comments are in {tmp_path / 'ds.json.orig'}, the file as it was" in result.output
    again = CliRunner().invoke(app, ["solve", "--target", "128", "--gpus", "8", "--max-micro", "16",
                                     "--deepspeed", str(ds), "--accelerate", str(acc)])
    assert again.exit_code == 0 and "its comments are in" not in again.output  # the header is ours to rewrite
    assert sorted(p.name for p in tmp_path.iterdir()) == ["acc.yaml", "acc.yaml.orig", "acc.yaml.orig.1", "ds.json",
                                                          "ds.json.orig"]


def test_the_python_writers_keep_a_commented_file_too(tmp_path):
    from autobatch import Plan
    from autobatch.configs import write_deepspeed_config
    from tests.extras import need

    need("hjson")
    ds = tmp_path / "ds.json"
    ds.write_text('{"train_batch_size": 64, /* ours */ "steps_per_print": 10}')
    write_deepspeed_config(Plan(4, 2, gpus_per_node=8), ds)
    assert (tmp_path / "ds.json.orig").read_text().startswith('{"train_batch_size": 64, /* ours */')
    assert json.loads(ds.read_text())["steps_per_print"] == 10


def test_a_comment_sign_inside_a_quoted_string_is_no_comment(tmp_path):
    """A path or a name with ``//`` or ``#`` in it is a value, not a comment: no copy is kept of a file
    that loses nothing, and a comment after a quote-like character still counts."""
    ds, acc = tmp_path / "ds.json", tmp_path / "acc.yaml"
    ds.write_text('{"tensorboard": {"enabled": true, "output_path": "s3://runs/#7", "job_name": "a \\" // b"},\n'
                  ' "train_batch_size": 64}\n')
    acc.write_text("num_machines: 1\nmain_process_ip: 'host#1'\ndeepspeed_config:\n  note: \"a # b\"\n")
    result = CliRunner().invoke(app, ["solve", "--target", "256", "--gpus", "8", "--max-micro", "16",
                                      "--deepspeed", str(ds), "--accelerate", str(acc)])
    assert result.exit_code == 0, result.output
    assert "its comments are in" not in result.output
    assert sorted(p.name for p in tmp_path.iterdir()) == ["acc.yaml", "ds.json"]
    assert json.loads(ds.read_text())["tensorboard"]["output_path"] == "s3://runs/#7"
    acc.write_text("num_machines: 1\nmain_process_ip: it's here  # the head node\n")
    again = CliRunner().invoke(app, ["solve", "--target", "256", "--gpus", "8", "--max-micro", "16",
                                     "--accelerate", str(acc)])
    assert again.exit_code == 0, again.output
    assert (tmp_path / "acc.yaml.orig").read_text().endswith("# the head node\n")


def test_a_commented_deepspeed_file_keeps_its_numbers_as_written(tmp_path):
    # read through hjson, "gradient_clipping": 1.0 came back as 1 while the line said it was kept as it was
    ds = tmp_path / "ds.json"
    ds.write_text('{\n  // ours\n  "gradient_clipping": 1.0, /* clip */ "lr": 3e-4,\n  "note": "a // b # c",\n'
                  '  "train_batch_size": "auto", "zero_optimization": {"stage": 0}\n}\n')
    result = CliRunner().invoke(app, ["solve", "--target", "16", "--max-micro", "8", "--deepspeed", str(ds)])
    assert result.exit_code == 0, result.output
    written = ds.read_text()
    assert '"gradient_clipping": 1.0' in written and '"lr": 0.0003' in written and '"note": "a // b # c"' in written
    assert json.loads(written)["train_batch_size"] == 16 and (tmp_path / "ds.json.orig").exists()


@pytest.mark.parametrize("command", [
    ["solve", "--target", "16"],
    ["find", "--model", "tiny-mlp", "--device", "cpu", "--memory", "2MiB", "--target", "16", "--max-micro", "16"],
    ["estimate", "--model", "tiny-mlp", "--gpu", "t4", "--target", "16"],
], ids=["solve", "find", "estimate"])
def test_a_folder_made_for_the_files_is_said_once(command, tmp_path):
    # the folder was made silently: a typo in it went unseen
    files = ["--deepspeed", str(tmp_path / "new" / "ds.json"), "--hf", str(tmp_path / "new" / "deeper" / "hf.json"),
             "--accelerate", str(tmp_path / "acc.yaml")]
    first = invoke(*command, *files)
    assert first.exit_code == 0, first.output
    said = [line for line in first.stderr.splitlines() if "made the folder" in line]
    assert said == [f"note: made the folders {tmp_path / 'new'}, {tmp_path / 'new' / 'deeper'}, which did not exist, "
                    "for the files written"], first.stderr
    again = invoke(*command, *files)
    assert again.exit_code == 0 and "made the folder" not in again.stderr
