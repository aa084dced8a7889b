"""``gearshift simulate -o json`` prints JSON alone, even when native code (HiGHS, in
Sia's MILP) writes to file descriptor 1 during the run."""

import os

from gearshift.sim.cli import stdout_to_stderr


def test_native_writes_to_fd1_go_to_stderr_while_policies_run(capfd):
    with stdout_to_stderr(True):
        os.write(1, b"HighsMipSolverData::transformNewIntegerFeasibleSolution\n")
    print("{}")
    out, err = capfd.readouterr()
    assert out == "{}\n" and "HighsMipSolverData" in err
    with stdout_to_stderr(False):
        os.write(1, b"kept\n")
    assert capfd.readouterr().out == "kept\n"
