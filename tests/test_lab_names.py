"""`moelab lab new` of a title a record already has, and `lab attach` of a folder that does not
exist: each says what it found and what was probably meant."""

from __future__ import annotations

from moelab.lab import records as rec_mod
from test_cli import run_main

NEW = ["lab", "new", "--hypothesis", "h", "--goal", "g", "--criterion", "train/loss <= 3"]


def test_a_second_record_of_one_title_is_created_with_a_warning_naming_the_first(tmp_path,
                                                                                 capsys):
    lab = ["--lab-dir", str(tmp_path / "lab")]
    rc, out, err = run_main([*NEW, "Bigger batch", *lab], capsys)
    assert rc == 0 and "warning" not in out + err
    for title, ids in (("Bigger batch", "0001-bigger-batch has"),
                       ("bigger batch!", "0001-bigger-batch, 0002-bigger-batch have")):
        rc, out, _ = run_main([*NEW, title, *lab], capsys)
        assert rc == 0 and f"warning: {ids} the same name, bigger-batch" in out, out
        assert "delete" in out and "attach runs to 0001-bigger-batch" in out
    assert [p.stem for p in rec_mod.record_files(tmp_path / "lab")] == [
        "0001-bigger-batch", "0002-bigger-batch", "0003-bigger-batch"]  # kept: a repeat is allowed
    rc, out, _ = run_main([*NEW, "Bigger batch again", *lab], capsys)
    assert rc == 0 and "warning" not in out  # another slug: no namesake


def test_attaching_a_folder_that_does_not_exist_says_so(tmp_path, capsys):
    lab = ["--lab-dir", str(tmp_path / "lab")]
    assert run_main([*NEW, "t", *lab], capsys)[0] == 0
    rc, _, err = run_main(["lab", "attach", "1", str(tmp_path / "nosuch"), *lab], capsys)
    assert rc == 2 and "not a run folder" not in err, err
    assert (f"{tmp_path / 'nosuch'}: no such folder; give a run folder `moelab train` wrote, or "
            "to attach a run before it starts, train it with `moelab train CONFIG --record 1 "
            "--arm NAME`") in err
