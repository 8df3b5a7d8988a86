"""What lasts between runs: run folders, analyzer states, validated loading of the files handed in, weight digests.

Run folders are written whole or not at all (:mod:`.runfolder`, :mod:`.inventory`); analyzer states and the classes they
may name (:mod:`.states`, :mod:`.trusted`); validated loading (:mod:`.safeload`); content digests (:mod:`.digests`).
"""
