"""The replay's last screen in a real terminal (tmux): one progress bar, finished, then the table;
no second bar, no half-drawn line (two processes drawing used to garble it)."""

from __future__ import annotations

import shutil
import subprocess
import sys
import uuid

import pytest

pytestmark = pytest.mark.slow


def test_the_last_screen_of_a_replay_in_tmux_is_clean(tmp_path):
    if shutil.which("tmux") is None:
        pytest.skip("tmux is not installed")
    session = f"kvservice-{uuid.uuid4().hex[:8]}"
    done = tmp_path / "done"
    command = (
        f"{sys.executable} -m kvservice.cli replay --limit 20 --out {tmp_path / 'out'}; "
        f"echo $? > {done}; tmux wait-for -S {session}; exec cat"
    )  # cat: the pane stays to be read
    subprocess.run(["tmux", "new-session", "-d", "-s", session, "-x", "300", "-y", "60", command], check=True)
    try:
        subprocess.run(["tmux", "wait-for", session], check=True, timeout=600)
        screen = subprocess.run(
            ["tmux", "capture-pane", "-p", "-t", session], capture_output=True, text=True, check=True
        ).stdout
    finally:
        subprocess.run(["tmux", "kill-session", "-t", session], capture_output=True)
    assert done.read_text().strip() == "0", screen
    (tmp_path / "screen.txt").write_text(screen)
    lines = [line for line in screen.splitlines() if line.strip()]
    assert lines[0].startswith("replay: the embedded Mooncake sample, first 20 requests; preset llama-3-8b")
    bars = [line for line in lines if line.startswith("replay:") and "req" in line and "|" in line]
    assert len(bars) == 1, screen
    assert "40/40" in bars[0] and "incremental 20/20, full 20/20" in bars[0], screen
    assert lines[-1].startswith("wrote ") and lines[-1].endswith("agreement.png"), screen
    assert "\x1b" not in screen and "Task exception" not in screen and "Traceback" not in screen
    table = [line for line in lines if line.startswith(("┃", "│", "┏", "┡", "└"))]
    assert len({len(line) for line in table}) == 1, screen  # every table row as wide as the frame
