------------------ MODULE MCUpstreamBackgroundThreadStatus ------------------
(* The model wrapper of upstream's protocol (expected failures): the same  *)
(* budgets as MCPauseProtocol's, and one for stray releases.  A stray      *)
(* release is enabled while the count is not yet negative, which bounds    *)
(* the model; one stray call is all D2 needs.                              *)
EXTENDS MCPauseProtocol, UpstreamBackgroundThreadStatus

MCStrayRelease(r) == "stray" \in Faults /\ count[r] >= 0 /\ StrayRelease(r)

MCUpstreamSpec ==
    /\ Init
    /\ [][UpstreamSystemNext \/ MCEnvironmentNext \/ \E r \in Ranks : MCStrayRelease(r)]_vars
    /\ UpstreamFairness
=============================================================================
