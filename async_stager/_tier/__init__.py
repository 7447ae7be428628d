"""The memory tier: a node agent that holds snapshot arenas received by file descriptor.

``wire`` (the protocol: framed messages over a Unix socket, descriptors by SCM_RIGHTS,
the socket's path and the peer check), ``agent`` (the service that holds each rank's
newest snapshots and hands them back), ``client`` (the trainer's side, every call
bounded in time), ``tier`` (the Checkpointer's use of it: snapshot to the agent,
restore from it). A layer above ``_dcp`` and below ``_checkpoint``.
"""
