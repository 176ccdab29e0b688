"""Running a step on several ranks without a framework: the collectives (``collectives``), the DFS step's
gradient over every rank (``step``), FSDP2 for tree walks (``sharding``, ``parallelize``), stopping every rank
when one fails (``faults``) and the Hugging Face export of a checkpoint (``export``)."""
