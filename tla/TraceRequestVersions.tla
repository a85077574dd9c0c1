------------------------ MODULE TraceRequestVersions ------------------------
(***************************************************************************)
(* Trace validation of RequestVersions (issue 40, point 2): the labels the *)
(* real loop gave its requests' tokens, replayed step by step.             *)
(*                                                                         *)
(* The log (cbpause.tlc.label_traces) holds the Submit records of the      *)
(* driver's PauseProtocol trace and the integration's label records        *)
(* (cbpause.core.recorder.LABEL_RECORDS), in the order of one clock: each  *)
(* must be the spec's step of the same name, and what it observed must be  *)
(* what the spec computes.  A forward step is a Launch and a Land (the     *)
(* loop without async batching lands each step before the next decision):  *)
(* the Launch names the requests it computes, the Land the two labels of   *)
(* each new token (R-VERSIONS, R-KV-VERSIONS) and, for a loop that samples *)
(* per request, the position of the request's seed's stream the token was  *)
(* drawn at, which must be the number of tokens the request held before it *)
(* (R-SAMPLING: a retract keeps the position, a restart from the prompt    *)
(* starts it again; -1, no position, for a loop that does not sample per   *)
(* request); an Output record carries a request's whole label sequences    *)
(* and whether it failed.  OpenWindow opens in the agreed mode (its Effect *)
(* included); DrainFirst is a drain that found work (OpenWindow(DRAIN)     *)
(* that does not open); CloseWindow applies the forgetting and the         *)
(* staleness bound, which the spec computes and the later records must     *)
(* agree with.  The scheduler's admission is not recorded: a request the   *)
(* next Launch computes may be admitted silently just before it            *)
(* (SilentAdmit), the spec's Admit guards and all.  Every invariant of the *)
(* spec is checked on every replayed state.                                *)
(***************************************************************************)
EXTENDS RequestVersions, Integers   \* Integers: -1, a Land of a token not sampled per request

CONSTANT Log

VARIABLE vi   \* the next record of the log

Rec == Log[vi]
LastOf(s) == s[Len(s)]
Grew == {j \in Requests : Len(lab'[j]) = Len(lab[j]) + 1}

TraceInit == Init /\ vi = 1

Recorded ==
    CASE Rec.a = "Submit" -> Rec.arg = 1 /\ Submit(Rec.q)
      [] Rec.a = "Launch" -> Launch /\ inFlight' = Rec.set
      [] Rec.a = "Land" ->
            /\ Land
            /\ Grew = {t[1] : t \in Rec.labs}
            /\ \A t \in Rec.labs : LastOf(lab'[t[1]]) = t[2] /\ LastOf(kvLab'[t[1]]) = t[3]
            /\ \A t \in Rec.labs : t[4] = -1 \/ DrawAtIndex(t[1], t[4])    \* R-SAMPLING
      [] Rec.a = "OpenWindow" -> OpenWindow(Rec.arg) /\ win' = Rec.arg
      [] Rec.a = "DrainFirst" -> OpenWindow(Rec.arg) /\ win' = 0 /\ drainAsked'
      [] Rec.a = "Update" -> Update
      [] Rec.a = "CloseWindow" -> CloseWindow
      [] Rec.a = "Output" ->
            /\ Deliver(Rec.q)
            /\ aborted[Rec.q] = (Rec.arg = 1)
            /\ lab[Rec.q] = Rec.w
            /\ kvLab[Rec.q] = Rec.kv
      [] OTHER -> FALSE

\* The requests due are admitted least first: an admission's effect does not depend on the others' (each reads
\* the version in force and the blocks kept), so one order covers them all, where every order cost TLC 2^N states
\* for a Launch of N new requests (a hostile review: 64 at once never finished).
Due == {j \in Rec.set : st[j] = "waiting"}
SilentAdmit ==
    /\ vi <= Len(Log)
    /\ Rec.a = "Launch"
    /\ Due # {}
    /\ Admit(CHOOSE j \in Due : \A k \in Due : j <= k)
    /\ UNCHANGED vi

TraceNext == (vi <= Len(Log) /\ Recorded /\ vi' = vi + 1) \/ SilentAdmit

TraceMatched == vi = Len(Log) + 1
NeverMatched == ~TraceMatched

\* At the end of the log every request was delivered (a run traced to its end collects every output): a log that
\* drops a request's Output, or stops with a request in flight, is rejected (a hostile review: TLC accepted such
\* logs once it reached their last record).  Checked before NeverMatched, which the same state breaks.
DeliveredAtEnd == TraceMatched => \A j \in Requests : st[j] = "delivered"
=============================================================================
