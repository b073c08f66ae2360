"""The framework-free half of pipeline parallelism, one concern a module.

    schedule     GPipe, 1F1B, ZB-H1 and interleaved 1F1B as action lists per stage; bubble and memory theory; a simulator
    partition    contiguous stages by parameters, measured time or the user's stage starts
    grid         PipelineRank: this rank's stage, replica, neighbours and process sets
    engine       PipelineEngineBase: walks a stage's schedule (a step of hvd_runtime.loop)
    checkpoint   the one-file checkpoint of every stage, written by rank 0
    timeline     per-rank spans, the measured bubble, the picture
    socket_link  the point-to-point link between neighbouring stages; p2p_header its message header

The framework-bound halves are hvd_runtime.torch.pipeline and hvd_runtime.tf.pipeline.
"""
