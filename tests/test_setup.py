"""scripts/setup.sh's parts that can run without changing the machine (unit tier)."""
import os
import subprocess

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LINK_COMMAND = os.path.join(REPO, "scripts", "link_command.sh")


def link(ours, at) -> str:
    r = subprocess.run(["bash", LINK_COMMAND, str(ours), str(at)], capture_output=True, text=True,
                       timeout=30)
    assert r.returncode == 0, r.stderr
    return r.stdout


def test_the_command_link_to_another_install_is_taken_over_and_said_so(tmp_path):
    ours, theirs, at = tmp_path / "ours", tmp_path / "theirs", tmp_path / "fusefs"
    assert link(ours, at) == "" and os.readlink(at) == str(ours)  # (new: nothing to say)
    assert link(ours, at) == ""                                   # (ours already)
    os.remove(at)
    os.symlink(theirs, at)
    said = link(ours, at)
    assert os.readlink(at) == str(ours)
    assert f"pointed to {theirs}" in said and "another install" in said and str(ours) in said


def test_a_command_there_that_is_not_a_link_is_left_alone_and_said_so(tmp_path):
    at = tmp_path / "fusefs"
    at.write_text("#!/bin/sh\n")
    said = link(tmp_path / "ours", at)
    assert not os.path.islink(at) and at.read_text() == "#!/bin/sh\n"
    assert "left alone" in said
