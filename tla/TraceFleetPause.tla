--------------------------- MODULE TraceFleetPause ---------------------------
(***************************************************************************)
(* Trace validation of a real server's lease table (issue 39), as          *)
(* TracePauseProtocol.tla does for the loop: replay the log a `cbpause     *)
(* serve` process wrote (`--lease-log`; cbpause.serve.leases.LeaseTable    *)
(* records each action under its lock, with FleetPause's name) against     *)
(* FleetPause's server steps, for one server.  A record names the action,  *)
(* its lease (the lease's epoch: the order in which the leases were        *)
(* entered, which is the order the write-order rule compares) and the      *)
(* version label the server has after it (`ver`: the epoch of the lease    *)
(* the weights were last fully written under, or Partial of it for a      *)
(* write cut at its deadline).  Each record must be an enabled             *)
(* step of the spec (Grant, Renew, RenewRefused, StartWrite, WriteRefused, *)
(* Received, WriteEnd, WriteFail, WriteCut, LeaseExpires, EndLease) that   *)
(* leaves that label.  A WriteBegin record says whether the write is a     *)
(* staged transfer (issue 42: `staged`), and every record whether the      *)
(* table holds the loop for torn weights after it (issue 57: `torn`, the  *)
(* code's LeaseTable.torn), which must be the spec's Torn.                 *)
(*                                                                         *)
(* Where the code is not the spec's atomic step, and only there:           *)
(*  - Time: the code's clock is not recorded.  The spec's Tick and         *)
(*    WriteTick are taken as needed, and only just before the record that  *)
(*    needs them (LeaseExpires of that lease, WriteCut).                   *)
(*  - ReleaseDeadHolder is the loop's, not the lease table's, and no      *)
(*    server step of the log tells a dead lease from a gone one (none is    *)
(*    honoured, granted again or resumed): it is left out, and an expired  *)
(*    lease stays "dead" in the replay.  (Taken whenever enabled, it made  *)
(*    the replay of a log with many expiries exponential: found by review.) *)
(*  - A write refused because another write runs (WriteBusy, a 409) is the *)
(*    spec's write message not taken yet, and the trainer never hearing    *)
(*    back: the record changes nothing, with a write under way.            *)
(*  - The trainer and the network are not in the log: their variables stay *)
(*    as Init leaves them (WriteEnd's answer joins `net`, unread).         *)
(***************************************************************************)
EXTENDS FleetPause, Sequences

CONSTANT Log

VARIABLE i  \* how many records of the log were matched

S == CHOOSE s \in Servers : TRUE

Others == <<trn, net, completed, fresh>>

TraceInit == Init /\ i = 0

Recorded(r) ==
    CASE r.a = "PauseLease"   -> Grant(S, r.e) /\ UNCHANGED Others
      [] r.a = "RenewLease"   -> Renew(S, r.e) /\ UNCHANGED Others
      [] r.a = "RenewRefused" -> RenewRefused(S, r.e) /\ UNCHANGED Others
      [] r.a = "WriteBegin"   -> StartWrite(S, r.e, IF r.staged THEN "receiving" ELSE "copying") /\ UNCHANGED Others
      [] r.a = "Received"     -> writing[S] = r.e /\ Received(S)
      [] r.a = "WriteRefused" -> (WriteRefused(S, r.e) \/ (writing[S] # 0 /\ UNCHANGED srv)) /\ UNCHANGED Others
      [] r.a = "WriteEnd"     -> writing[S] = r.e /\ WriteEnd(S)
      [] r.a = "WriteCut"     -> writing[S] = r.e /\ WriteCut(S) /\ UNCHANGED net
      [] r.a = "WriteFail"    -> writing[S] = r.e /\ WriteFail(S)
      [] r.a = "LeaseExpires" -> LeaseExpires(S, r.e) /\ UNCHANGED <<net, fresh>>
      [] r.a = "ResumeLease"  -> lease[S][r.e] = "held" /\ EndLease(S, r.e) /\ UNCHANGED Others

TraceNext ==
    \/ /\ i < Len(Log)
       /\ Recorded(Log[i + 1])
       /\ ver'[S] = Log[i + 1].ver
       /\ Log[i + 1].torn = (TornHold /\ ver'[S] > MaxEpoch)
       /\ i' = i + 1
    \/ /\ i < Len(Log) /\ Log[i + 1].a = "LeaseExpires"
       /\ Tick(S, Log[i + 1].e)
       /\ UNCHANGED i
    \/ /\ i < Len(Log) /\ Log[i + 1].a = "WriteCut"
       /\ WriteTick(S)
       /\ UNCHANGED i

\* The trace is matched: a behaviour of the spec went through every record.  TLC is asked for a state where this
\* holds as TracePauseProtocol asks: the invariant NeverMatched fails exactly there, and the trace is accepted then.
TraceMatched == i = Len(Log)
NeverMatched == ~TraceMatched
=============================================================================
