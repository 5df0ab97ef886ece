"""The loop's side jobs: metrics, spike handling, goodput, the watchdog, the run lock."""
