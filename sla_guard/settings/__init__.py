"""Settings models of the parts above the config (the detectors, the scaling advisor), kept
below it so ``GuardConfig`` can type its ``detectors:`` and ``advisor:`` sections directly and
report their errors with the field path, while the parts that use them import them from here."""
