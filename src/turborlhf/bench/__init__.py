"""`turborlhf bench`: side-by-side speed and memory of turborlhf and a peer (TRL, HF `generate`)
on this machine, in one run, alternating the two as separate child processes.

Modules (none imports torch: the harness process stays small; the work happens in children):

- `measure`: run one child process, poll the resident memory of its whole process tree, return
  its wall time, exit code and peak RSS;
- `peers`: install a peer (TRL at a pinned version) into its own cached folder with pip, never
  into the running environment;
- `data`: the HH-RLHF sample → the prompts/pairs files both sides read;
- `workloads`: per subcommand, the shared settings, our command (a trainer with a
  ``configs/bench`` config) and the peer's (a script in ``benchmarks/peers``), and how each
  reports its per-step times;
- `report`: statistics, the result object (``--json``) and the table;
- `cli`: argument parsing and the alternating schedule.
"""
