"""TensorBoard output: the tag names (``tags``), the memory dashboard layout and its readability rules
(``layout``, ``dashboard``), figures of the records (``figures``) and a local server (``server``)."""
