"""The reliability campaign's own material (`tools/reliability.py` runs it; tests import it by path).

What an engine can run on its own model stays in `graphcap.testing`; this package holds the
campaign's cases and experiments, one room per area, each returning rows of the table that
`record.py` writes to docs/RELIABILITY.md.

| module | holds |
|---|---|
| `trials.py` | `Scale` (full or quick), `Tally` (a trial passes when its body raises nothing), `Row` |
| `configs.py` | bad configs: fixtures, generated mistakes, hostile YAML, random documents, data-parallel ranks |
| `steps.py` | hostile and fuzzed steps, per-request outputs, whole engine buffers, stored inf, the null block |
| `moved_inputs.py` | static inputs moved after capture; forwards that freeze a host value |
| `capture_faults.py` | faults at each phase of capture, and a report write that fails after the pass |
| `streams.py` | poisoned random streams and threads on one manager (with the lock removed as control) |
| `command_line.py` | the hostile command cases by area, and Ctrl-C at each stage of `graphcap verify` |
| `lifecycle.py` | the mini engine's lifecycle run, release/capture and resize_kv cycles |
| `checks.py` | lazy capture across a changed static input, scratch blocks a live row holds, sampled live steps |
| `live_faults.py` | models that pass capture verification, then go wrong (also `tests/test_sampling.py`) |
| `record.py` | the machine and the document |
| `cli_cases.py` | hostile and careless uses of the `graphcap` command, as data (also `tests/cli/`) |
| `cli_setups.py` | the files, factories, faults and checks those cases use |
| `interrupts.py` | Ctrl-C at each stage of a running command (also `tests/cli/test_startup.py`) |
| `dp_agreement.py` | data-parallel ranks with different configs |
| `outputs.py` | per-request outputs, whole engine buffers, stored inf, the null block (also `tests/reliability/`) |

Modules import each other relatively; `tools/` must be on `sys.path` (it is for a script in
`tools/`; tests insert it), and `lifecycle.py` imports `tools/mini_engine.py` from there.
"""
