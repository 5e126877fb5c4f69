"""The flight recorder and the post-mortem file of a step or capture that died.

`FlightRecorder` (`recorder`) keeps the host rows of the last `report.flight_steps` staged steps in a
ring of preallocated arrays; when an exception leaves `execute`, `capture` or `capture_pending`,
`write_postmortem` (`file`) writes them to `report.postmortem` and names the file on the error.
`recheck` re-checks a file's steps on numpy alone (`graphcap inspect FILE`).
"""
