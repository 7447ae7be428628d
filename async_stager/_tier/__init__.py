"""The memory tier: a node agent that holds snapshot arenas received by file descriptor.

``wire`` (the protocol: framed messages over a Unix socket, descriptors by SCM_RIGHTS,
the socket's path and the peer check), ``regions`` (snapshot regions and digests),
``agent`` (the service that holds each rank's snapshots and hands them back),
``service`` (its memory bound and lifetime), ``client`` (the trainer's side, every call
bounded in time), ``retention`` (which snapshots a rank may let go: the job's promise),
``stats`` (what the tier reports), ``replica`` (replicas on another node: placement,
transfer, pacing), ``replicator`` (one rank's replication and a restore's transfers),
``tier`` (the Checkpointer's use of it: snapshot to
the agent, restore from it). A layer above ``_dcp`` and below ``_checkpoint``.
"""
