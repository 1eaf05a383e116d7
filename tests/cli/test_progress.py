"""Progress on long work: plain lines with counts and an ETA when stderr is a log file."""

import io

from kvq.cli.progress import PlainProgress, RichProgress, cli_progress


def test_plain_lines_count_and_estimate_the_rest(monkeypatch):
    now = [0.0]
    monkeypatch.setattr("time.perf_counter", lambda: now[0])
    out = io.StringIO()
    progress = PlainProgress(out)
    with progress, progress.stage("fit codebooks", total=5) as bar:
        for t in (5.0, 15.0, 25.0, 35.0):  # the first item takes 5 s, the others 10 s
            now[0] = t
            bar.advance()
        now[0] = 40.0
    lines = out.getvalue().splitlines()
    assert lines[0] == "fit codebooks: started (0/5)"
    # the rate runs from the first item (a stage's set-up often lands in it): 10 s an item
    assert "fit codebooks: 2/5, 0:15 elapsed, eta 0:30" in lines
    assert "fit codebooks: 4/5, 0:35 elapsed, eta 0:10" in lines
    assert lines[-1] == "fit codebooks: done in 0:40 (4/5)"
    assert progress.seconds["fit codebooks"] == 40.0


def test_a_log_file_gets_plain_lines_a_terminal_gets_bars():
    assert isinstance(cli_progress(terminal=False), PlainProgress)
    assert isinstance(cli_progress(terminal=True), RichProgress)
    assert isinstance(cli_progress(), PlainProgress)  # pytest captures stderr: not a terminal
