------------------ MODULE MCUpstreamBackgroundThreadStatus ------------------
(* The model wrapper of upstream's protocol (expected failures): the same  *)
(* budgets as MCPauseProtocol's, and one for stray releases.  A stray      *)
(* release is enabled while the count is not yet negative, which bounds    *)
(* the model; one stray call is all D2 needs.  Upstream has no pause       *)
(* timeout, so "timeout" in Faults does nothing here.                      *)
EXTENDS MCPauseProtocol, UpstreamBackgroundThreadStatus

MCUpstreamInterrupt(h) == "interrupt" \in Faults /\ UpstreamInterrupt(h)
MCStrayRelease(r) == "stray" \in Faults /\ count[r] >= 0 /\ StrayRelease(r)
MCUpstreamFailLoop(r) == "error" \in Faults /\ UpstreamFailLoop(r)
MCUpstreamRestart == restarts < MaxRestarts /\ UpstreamRestart

MCUpstreamEnvironmentNext ==
    \/ \E h \in Holders : MCUpstreamInterrupt(h)
    \/ \E r \in Ranks : \E s \in {FLUSH_AND_STOP, HARD_STOP} : MCRequestStop(r, s)
    \/ \E r \in Ranks : MCRecordFatalError(r) \/ MCUpstreamFailLoop(r) \/ MCCrash(r) \/ MCStrayRelease(r)
    \/ MCUpstreamRestart

MCUpstreamSpec == Init /\ [][UpstreamSystemNext \/ MCUpstreamEnvironmentNext]_vars /\ UpstreamFairness
=============================================================================
