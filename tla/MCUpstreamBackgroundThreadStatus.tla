------------------ MODULE MCUpstreamBackgroundThreadStatus ------------------
(* The model wrapper of upstream's protocol (expected failures): the same  *)
(* budgets as MCPauseProtocol's, and one for stray releases.  A stray      *)
(* release is enabled while the count is not yet negative, which bounds    *)
(* the model; one stray call is all D2 needs.  Upstream has no pause       *)
(* timeout, so "timeout" in Faults does nothing here.  MCUpstreamSelfPause- *)
(* Spec is D4's: the holders are the loop's own thread.                    *)
EXTENDS MCPauseProtocol, UpstreamBackgroundThreadStatus

MCUpstreamInterrupt(h) == "interrupt" \in Faults /\ UpstreamInterrupt(h)
MCStrayRelease(r) == "stray" \in Faults /\ count[r] >= 0 /\ StrayRelease(r)
MCUpstreamFailLoop(r) == "error" \in Faults /\ UpstreamFailLoop(r)
MCUpstreamRestart == restarts < MaxRestarts /\ UpstreamRestart
MCUpstreamCancel(i) == "cancel" \in Faults /\ UpstreamCancel(i)
MCUpstreamThreadKilled(r) == "kill" \in Faults /\ UpstreamThreadKilled(r)

MCUpstreamEnvironmentNext ==
    \/ \E h \in Holders : MCUpstreamInterrupt(h)
    \/ \E r \in Ranks : \E s \in {FLUSH_AND_STOP, HARD_STOP} : MCRequestStop(r, s)
    \/ \E r \in Ranks : MCRecordFatalError(r) \/ MCUpstreamFailLoop(r) \/ MCCrash(r) \/ MCStrayRelease(r)
    \/ \E r \in Ranks : MCUpstreamThreadKilled(r)
    \/ \E i \in Requests : MCUpstreamCancel(i)
    \/ MCUpstreamRestart

\* Upstream_D5_broadcast's filter: a rank's first failure comes while the driver
\* holds a payload at its body (at the payload broadcast), and a request is
\* enqueued only while the driver's loop runs, so that no other path of D5
\* (the all-reduce, a hard stop, the late enqueue) is the one TLC reports.
FailuresOnlyAtTheBroadcast ==
    /\ \A r \in Ranks : (~fatal[r] /\ fatal'[r]) => (phase[Driver] = "body" /\ InHand)
    /\ \A i \in Requests : (req[i] = "admitted" /\ req'[i] = "queued") => Live(Driver)

MCUpstreamSpec == Init /\ [][UpstreamSystemNext \/ MCUpstreamEnvironmentNext]_vars /\ UpstreamFairness

-----------------------------------------------------------------------------
(* D4: pause() from the loop's own thread (a callback or a logits          *)
(* processor).  In this spec every holder is code that the loop of its     *)
(* rank runs during a forward step: it calls pause() only in the phase     *)
(* "step", and while it waits the loop's thread is inside that call, so    *)
(* its rank's loop takes no step.  Upstream has no check of the thread:    *)
(* the pause waits for a window that only the blocked loop can open        *)
(* (PauseReturnsProp fails).  Our pause() raises at once on the loop's     *)
(* thread (R-NO-SELF-PAUSE), which the protocol's models, having no        *)
(* thread identity, check in Python.                                       *)

\* Each loop action of upstream's, on a rank whose thread is not inside a
\* pause() call (TLC names each after its wrapper: MCStartStep is StartStep).
LoopThreadFree(r) == ~\E h \in HoldersOf(r) : hs[h] = "waiting"
MCUpstreamObserve(r) == LoopThreadFree(r) /\ UpstreamObserve(r)
MCUpstreamOpenWindow(r) == LoopThreadFree(r) /\ UpstreamOpenWindow(r)
MCUpstreamCollectiveTimeout(r) == LoopThreadFree(r) /\ UpstreamCollectiveTimeout(r)
MCCloseWindow(r) == LoopThreadFree(r) /\ CloseWindow(r)
MCNoPause(r) == LoopThreadFree(r) /\ NoPause(r)
MCStartStep(r) == LoopThreadFree(r) /\ StartStep(r)
MCEndStep(r) == LoopThreadFree(r) /\ EndStep(r)
MCIdle(r) == LoopThreadFree(r) /\ Idle(r)
MCUpstreamExitLoop(r) == LoopThreadFree(r) /\ UpstreamExitLoop(r)
SelfPauseLoopAction(r) ==
    \/ MCUpstreamObserve(r) \/ MCUpstreamOpenWindow(r) \/ MCUpstreamCollectiveTimeout(r)
    \/ MCCloseWindow(r) \/ MCNoPause(r) \/ MCStartStep(r) \/ MCEndStep(r) \/ MCIdle(r)
    \/ MCUpstreamExitLoop(r)
\* The holder's pause(), from code the loop runs in a forward step.
MCUpstreamRequestPause(h) == phase[RankOf[h]] = "step" /\ UpstreamRequestPause(h)

MCUpstreamSelfPauseNext ==
    \/ \E r \in Ranks : SelfPauseLoopAction(r)
    \/ AllReduce \/ Barrier \/ Broadcast
    \/ \E h \in Holders : MCUpstreamRequestPause(h) \/ UpstreamHolderWakes(h) \/ UpstreamLeavePause(h)
    \/ \E i \in Requests : UpstreamAdmit(i) \/ UpstreamEnqueue(i) \/ Deliver(i)
    \/ Terminated
    \/ MCUpstreamEnvironmentNext

MCUpstreamSelfPauseSpec ==
    /\ Init /\ [][MCUpstreamSelfPauseNext]_vars
    /\ \A r \in Ranks : WF_vars(SelfPauseLoopAction(r))
    /\ WF_vars(AllReduce) /\ WF_vars(Barrier) /\ WF_vars(Broadcast)
    /\ \A h \in Holders : WF_vars(UpstreamHolderWakes(h))
    /\ \A i \in Requests : WF_vars(Deliver(i)) /\ WF_vars(UpstreamEnqueue(i))
=============================================================================
