"""The run supervisor's side in the container (stdlib only, Python 3.8+), one module per job:
common (answers, files, lock, process identity), state (what a run is), start (pre-flight, GPU
check, detached start), supervise (restarts, queue), hooks, listing (list/show/stop), read (log
stream) and pack (runs pull). Installed by content hash and run by path: dflashctl/agent.py."""
