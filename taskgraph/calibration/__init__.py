"""Learning from end-to-end measurements: the measurements file format (:mod:`.measurements`)
and ``tg fit``, which fits machine and implementation profiles to it by simulation
(:mod:`.fit`)."""
