"""What lasts between runs: run folders written whole or not at all (:mod:`.runfolder`), analyzer states and their trusted
classes (:mod:`.states`, :mod:`.trusted`), validated loading of users' files (:mod:`.safeload`) and content digests
(:mod:`.digests`)."""
