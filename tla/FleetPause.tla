----------------------------- MODULE FleetPause -----------------------------
(***************************************************************************)
(* Pauses over the network (issue 29; spec/PROTOCOL.md section 6.6): a    *)
(* trainer (cbpause.client.Fleet) pauses a fleet of servers (cbpause       *)
(* serve), writes weights into them, and lets them go.  A pause held over  *)
(* HTTP is a lease: the server holds it on the trainer's behalf until the  *)
(* trainer resumes it, or until it is not renewed within its ttl.  An      *)
(* expired lease is PauseProtocol's dead holder: LeaseExpires is           *)
(* HolderDies (the lease's thread ends without leaving; from then on the   *)
(* lease is honoured no more), and ReleaseDeadHolder drops its hold, as    *)
(* the loop does within HOLDER_CHECK_S.  What happens inside one server    *)
(* (the window, its modes, the requests) is PauseProtocol's and            *)
(* RequestVersions' business; here a server is paused while it holds a    *)
(* lease, live or dead.                                                    *)
(*                                                                         *)
(* The network loses any message and delivers the others in any order      *)
(* (HTTP requests whose client gave up are still served: a late write is   *)
(* a message delivered late).  The trainer may crash at any moment; a      *)
(* server may crash (its leases die with it) and restart with its          *)
(* checkpoint's weights (version 0).  Time is each lease's countdown       *)
(* (Tick), which a renewal resets: a trainer may always be too slow.       *)
(*                                                                         *)
(* A write is two steps (issue 39): WriteBegin under the writer's own     *)
(* lease, then WriteEnd, which may never come (a hung filesystem or       *)
(* device: nothing makes it fair).  While it runs the lease does not      *)
(* expire, until the write's own deadline (WriteTTL ticks): then WriteCut  *)
(* ends the lease without the write and labels the weights partial.  The  *)
(* trainer may also hang (TrainerHang): it stops, its leases unrenewed.   *)
(*                                                                         *)
(* Two trainers (issue 39, point 13): NTrainers take their pauses at the  *)
(* same time, and each server enters the leases in the order their        *)
(* requests arrive there (seq: LeaseTable's own count), which may differ   *)
(* from server to server.  The write fence (Fence) refuses a write while   *)
(* the weights were last written under another lease that is still held: *)
(* a trainer told its update is complete finds every server holding it    *)
(* for as long as it holds its leases (NoMixedWhileComplete); without the  *)
(* fence the write-order rule alone lets a later lease overwrite it on one *)
(* server and be refused on the other.                                     *)
(*                                                                         *)
(* A write by broadcast (issue 42; Broadcast = TRUE): the trainer sends   *)
(* the tensors over a torch.distributed group while the server receives   *)
(* them into staging buffers (stage "receiving": the model untouched);     *)
(* Received, once every tensor arrived and every member said so, starts    *)
(* the copy (stage "copying"), which may fail or be cut as a disk write's. *)
(* The trainer's side is the sending: a server receives only while its    *)
(* trainer writes.  A transfer that fails (a peer lost, a deadline, the    *)
(* trainer gone) leaves the weights and their label as they were           *)
(* (TransferFailureKeepsWeights).                                          *)
(*                                                                         *)
(* Bounded staging (issue 57; Staged = FALSE, the servers' default): the   *)
(* server copies each bucket into the model as it arrives, once it is      *)
(* checked.  Received is then the first bucket's copy, and the rest of the *)
(* transfer still needs its trainer sending.  Staged = TRUE is the full    *)
(* copy (`cbpause serve --staging full`): every bucket staged first, the   *)
(* copy local once Received.  Either way a write torn after its first     *)
(* tensor (WriteFail, WriteCut) leaves the weights a mix, labelled         *)
(* Partial: with TornHold the server then holds its own loop paused and    *)
(* refuses generation (Torn) until a complete write (WriteEnd) or a        *)
(* restart: a torn update is never served (TornNeverServed), and only a   *)
(* complete write mends it (TornMendedOnlyByWrite).  TornHold = FALSE is   *)
(* the server before issue 57, which served the mix labelled: it must fail *)
(* TornNeverServed.                                                        *)
(*                                                                         *)
(* Leased = FALSE is a vLLM-style boolean pause: no ttl, and any resume    *)
(* un-pauses the server; it must fail NoPausedForEverProp.  WriteOrder = FALSE *)
(* drops the server's rule that a write under an older lease never         *)
(* overwrites one under a newer lease; it must fail                        *)
(* CompletedUpdateVisible (a write delayed past the next pause).           *)
(***************************************************************************)
EXTENDS Naturals, FiniteSets

CONSTANTS
    Servers,      \* the fleet
    MaxEpoch,     \* pauses the trainer takes, one after the other
    MaxLosses,    \* messages the network loses in a behaviour
    TTL,          \* ticks a lease lives without a renewal
    MaxRestarts,  \* server crashes (each followed, or not, by a restart)
    Leased,       \* TRUE: leases with a ttl (cbpause); FALSE: a boolean pause (vLLM)
    WriteOrder,   \* TRUE: a write under an older lease never overwrites a newer lease's
    WriteTTL,     \* ticks a write may run before it is cut
    OwnLease,     \* TRUE: a write is honoured under the writer's own lease only (FALSE: under any held lease)
    NTrainers,    \* trainers, each with its own pauses (pause e is trainer Owner(e)'s)
    Fence,        \* TRUE: no write while the weights were last written under another lease still held
    Broadcast,    \* TRUE: the trainers write by broadcast (a staged transfer, then the copy); FALSE: from disk
    Staged,       \* TRUE: a transfer is staged whole before the copy; FALSE: each bucket copied as it arrives (bounded)
    TornHold      \* TRUE: a server whose weights are torn holds its loop paused until a complete write

Epochs == 1..MaxEpoch
Trainers == 1..NTrainers
\* The pauses are numbered across the trainers, in turn: the trainer of pause e (0: the checkpoint's weights, nobody's).
Owner(e) == IF e = 0 THEN 0 ELSE ((e - 1) % NTrainers) + 1
\* The trainer writes once per pause, the version of pause e being e (version 0: the checkpoint's weights); a write of
\* pause e cut at its deadline leaves the weights labelled Partial(e) (PartialSync), which says which update failed.
Partial(e) == MaxEpoch + e
Versions == 0..(2 * MaxEpoch)
\* The update a version label stands for (a partial one's too).
Of(v) == IF v > MaxEpoch THEN v - MaxEpoch ELSE v
Msgs == [t : {"pause", "grant", "resume", "write", "bwrite", "wok"}, s : Servers, e : Epochs]

VARIABLES
    \* the servers
    up,        \* up[s]: the process runs
    lease,     \* lease[s][e]: "none", "held", "dead" (expired, its hold not released yet), "gone"
    ttl,       \* ttl[s][e]: ticks left before a held lease expires
    ver,       \* ver[s]: the weight version the server generates with
    wroteEp,   \* wroteEp[s]: the epoch of the lease under which ver[s] was written (0: none)
    seq,       \* seq[s][e]: the order in which s entered lease e (LeaseTable's Lease.seq; 0: not entered)
    nseq,      \* nseq[s]: leases s entered so far
    writing,   \* writing[s]: the epoch of the lease under which a write runs on s (0: none)
    wtime,     \* wtime[s]: ticks left before the write under way is cut
    stage,     \* stage[s]: of the write under way, "receiving" (a transfer, into staging), "copying", or "none"
    serverCrashes,  \* crashes so far (bounded by MaxRestarts)
    losses,    \* messages lost so far (bounded by MaxLosses)
    \* the trainers, each a function of the trainer
    trainer,   \* "idle", "pausing", "holding", "writing", "release", "done", "crashed", "hung"
    epoch,     \* its current pause
    granted,   \* servers that granted this epoch's lease
    lostS,     \* servers that refused a renewal: the lease is gone there
    wrote,     \* it wrote in this pause
    acked,     \* servers that acknowledged the write
    missed,    \* servers the trainer reports as having missed the write
    \* the network and the history
    net,       \* messages in flight
    completed, \* the last version every server acknowledged (0: none yet)
    fresh      \* fresh[s]: s has not restarted since it last took a write

srv == <<up, lease, ttl, ver, wroteEp, seq, nseq, writing, wtime, stage, serverCrashes, losses>>
trn == <<trainer, epoch, granted, lostS, wrote, acked, missed>>
vars == <<srv, trn, net, completed, fresh>>

LeaseStates == {"none", "held", "dead", "gone"}

TypeOK ==
    /\ up \in [Servers -> BOOLEAN]
    /\ lease \in [Servers -> [Epochs -> LeaseStates]]
    /\ ttl \in [Servers -> [Epochs -> 0..TTL]]
    /\ ver \in [Servers -> Versions]
    /\ wroteEp \in [Servers -> 0..MaxEpoch]
    /\ seq \in [Servers -> [Epochs -> 0..MaxEpoch]] /\ nseq \in [Servers -> 0..MaxEpoch]
    /\ writing \in [Servers -> 0..MaxEpoch]
    /\ wtime \in [Servers -> 0..WriteTTL]
    /\ stage \in [Servers -> {"none", "receiving", "copying"}]
    /\ serverCrashes \in 0..MaxRestarts
    /\ losses \in 0..MaxLosses
    /\ trainer \in [Trainers -> {"idle", "pausing", "holding", "writing", "release", "done", "crashed", "hung"}]
    /\ epoch \in [Trainers -> 0..MaxEpoch]
    /\ granted \in [Trainers -> SUBSET Servers] /\ lostS \in [Trainers -> SUBSET Servers]
    /\ acked \in [Trainers -> SUBSET Servers] /\ missed \in [Trainers -> SUBSET Servers]
    /\ wrote \in [Trainers -> BOOLEAN] /\ completed \in Versions
    /\ net \subseteq Msgs
    /\ fresh \in [Servers -> BOOLEAN]

\* The weights are torn (a write stopped after its first tensor: labelled Partial) and the server holds its loop for it
\* (LeaseTable.torn, taken in the step that labels them); the generation routes refuse while it does.
Torn(s) == TornHold /\ up[s] /\ ver[s] > MaxEpoch
Paused(s) == up[s] /\ ((\E e \in Epochs : lease[s][e] \in {"held", "dead"}) \/ Torn(s))
\* A server that steps its loop and takes generation requests.
Serving(s) == up[s] /\ ~Paused(s)
AllRunning == \A s \in Servers : ~Paused(s)

\* A lease the server honours (a renewal, a write, a resume): held, never expired.  The boolean pause honours
\* anything while paused.
Honoured(s, e) == IF Leased THEN lease[s][e] = "held" ELSE \E f \in Epochs : lease[s][f] = "held"
\* The lease a write is honoured under: its own (OwnLease), or any held one (the mutant FleetPause_any_lease).
WriteHonoured(s, e) == IF OwnLease THEN Honoured(s, e) ELSE \E f \in Epochs : Honoured(s, f)

Init ==
    /\ up = [s \in Servers |-> TRUE]
    /\ lease = [s \in Servers |-> [e \in Epochs |-> "none"]]
    /\ ttl = [s \in Servers |-> [e \in Epochs |-> 0]]
    /\ ver = [s \in Servers |-> 0]
    /\ wroteEp = [s \in Servers |-> 0]
    /\ seq = [s \in Servers |-> [e \in Epochs |-> 0]] /\ nseq = [s \in Servers |-> 0]
    /\ writing = [s \in Servers |-> 0] /\ wtime = [s \in Servers |-> 0]
    /\ stage = [s \in Servers |-> "none"]
    /\ serverCrashes = 0 /\ losses = 0
    /\ trainer = [t \in Trainers |-> "idle"] /\ epoch = [t \in Trainers |-> 0]
    /\ granted = [t \in Trainers |-> {}] /\ lostS = [t \in Trainers |-> {}] /\ wrote = [t \in Trainers |-> FALSE]
    /\ acked = [t \in Trainers |-> {}] /\ missed = [t \in Trainers |-> {}]
    /\ net = {}
    /\ completed = 0
    /\ fresh = [s \in Servers |-> TRUE]

Send(ms) == net' = net \cup ms

\* A server's answer reaches the trainer's connection; a crashed trainer has none (the answer goes nowhere).
Answer(m, a) == net' = (net \ {m}) \cup (IF trainer[Owner(m.e)] = "crashed" THEN {} ELSE {a})

ToTrainer == {"grant", "wok"}

----------------------------------------------------------------------------
\* The server's own steps, apart from the messages that carry them: what cbpause.serve.leases.LeaseTable does, each
\* under its lock, and what its log records under the same name (TraceFleetPause.tla replays a real server's log
\* with these).

\* A new lease (PauseLease), entered: a late or repeated request for an epoch already seen gets none.  It is the
\* server's nseq + 1-th (Lease.seq: the order the write-order rule compares, which differs from server to server).
Grant(s, e) ==
    /\ up[s] /\ lease[s][e] = "none"
    /\ lease' = [lease EXCEPT ![s][e] = "held"]
    /\ ttl' = [ttl EXCEPT ![s][e] = TTL]
    /\ nseq' = [nseq EXCEPT ![s] = @ + 1]
    /\ seq' = [seq EXCEPT ![s][e] = nseq[s] + 1]
    /\ UNCHANGED <<up, ver, wroteEp, writing, wtime, stage, serverCrashes, losses>>

\* RenewLease, honoured (LeaseTable.renew_lease) or refused (410: the lease is gone).
Renew(s, e) ==
    /\ up[s] /\ Honoured(s, e)
    /\ ttl' = [ttl EXCEPT ![s][e] = TTL]
    /\ UNCHANGED <<up, lease, ver, wroteEp, seq, nseq, writing, wtime, stage, serverCrashes, losses>>
RenewRefused(s, e) == up[s] /\ ~Honoured(s, e) /\ UNCHANGED srv

\* WriteBegin, taken or refused (410, 409: LeaseTable.write_weights); one write at a time per server.  The
\* write-order rule: not under a lease entered before the one the weights were last written under (Superseded).  The
\* fence: not while the weights were last written under another lease still held (Fenced).
\* (IF, not \/: inside an action TLC takes every disjunct as a branch, and seq[s][0] is no value.)
InOrder(s, e) == IF wroteEp[s] = 0 THEN TRUE ELSE seq[s][e] >= seq[s][wroteEp[s]]
Unfenced(s, e) == IF wroteEp[s] \in {0, e} THEN TRUE ELSE lease[s][wroteEp[s]] # "held"
WriteAllowed(s, e) == WriteHonoured(s, e) /\ (WriteOrder => InOrder(s, e)) /\ (Fence => Unfenced(s, e))
StartWrite(s, e, p) ==
    /\ up[s] /\ writing[s] = 0 /\ WriteAllowed(s, e)
    /\ writing' = [writing EXCEPT ![s] = e]
    /\ stage' = [stage EXCEPT ![s] = p]
    /\ wtime' = [wtime EXCEPT ![s] = WriteTTL]
    /\ wroteEp' = [wroteEp EXCEPT ![s] = e]
    /\ UNCHANGED <<up, lease, ttl, ver, seq, nseq, serverCrashes, losses>>
\* A write to a torn server may be refused too (StillTorn: one that does not cover every tensor the torn writes were to
\* write could not mend them; the model's writes carry no tensor names, so any may be).
WriteRefused(s, e) == up[s] /\ writing[s] = 0 /\ (~WriteAllowed(s, e) \/ Torn(s)) /\ UNCHANGED srv

\* ResumeLease (LeavePause), once no write runs under the lease (LeaseTable._hold); a lease not held is left as it
\* is.  The boolean pause un-pauses.
EndLease(s, e) ==
    /\ up[s] /\ writing[s] # e
    /\ lease' = IF Leased
                THEN [lease EXCEPT ![s][e] = IF @ = "held" THEN "gone" ELSE @]
                ELSE [lease EXCEPT ![s] = [f \in Epochs |-> IF @[f] = "held" THEN "gone" ELSE @[f]]]
    /\ UNCHANGED <<up, ttl, ver, wroteEp, seq, nseq, writing, wtime, stage, serverCrashes, losses>>

----------------------------------------------------------------------------
\* The trainers (cbpause.client.Fleet), each in a process of its own: a step of trainer t changes t's variables only.
Set(f, t, v) == f' = [f EXCEPT ![t] = v]

\* The trainer's next pause (0: it has taken all of its own).
NextPause(t) == IF \E e \in Epochs : Owner(e) = t /\ e > epoch[t]
           THEN CHOOSE e \in Epochs : Owner(e) = t /\ e > epoch[t] /\ \A f \in Epochs : Owner(f) = t /\ f > epoch[t] => e <= f
           ELSE 0
\* Where it goes once a pause ends: idle, or done once it has taken its last.
After(t) == IF NextPause(t) = 0 THEN "done" ELSE "idle"

\* Fleet.pause(): a lease asked of every server.
TrainerPause(t) ==
    /\ trainer[t] = "idle" /\ NextPause(t) # 0
    /\ Set(epoch, t, NextPause(t))
    /\ Set(trainer, t, "pausing") /\ Set(granted, t, {}) /\ Set(lostS, t, {}) /\ Set(wrote, t, FALSE)
    /\ Send({[t |-> "pause", s |-> s, e |-> NextPause(t)] : s \in Servers})
    /\ UNCHANGED <<srv, acked, missed, completed, fresh>>

TrainerGranted(m) ==
    LET t == Owner(m.e) IN
    /\ m \in net /\ m.t = "grant" /\ trainer[t] = "pausing" /\ m.e = epoch[t]
    /\ Set(granted, t, granted[t] \cup {m.s})
    /\ Set(trainer, t, IF granted[t] \cup {m.s} = Servers THEN "holding" ELSE "pausing")
    /\ net' = net \ {m}
    /\ UNCHANGED <<srv, epoch, lostS, wrote, acked, missed, completed, fresh>>

\* A stale answer (of an older epoch, or one the trainer no longer waits for) is read and dropped.
TrainerDrops(m) ==
    LET t == Owner(m.e) IN
    /\ m \in net /\ m.t \in ToTrainer
    /\ \/ m.e # epoch[t]
       \/ m.t = "grant" /\ trainer[t] # "pausing"
       \/ m.t = "wok" /\ trainer[t] # "writing"
    /\ trainer[t] # "crashed"
    /\ net' = net \ {m}
    /\ UNCHANGED <<srv, trn, completed, fresh>>

\* Fleet.pause() gives up (a server did not answer within the timeout): the leases taken are resumed.
TrainerPauseFails(t) ==
    /\ trainer[t] = "pausing"
    /\ Send({[t |-> "resume", s |-> s, e |-> epoch[t]] : s \in granted[t]})
    /\ Set(trainer, t, After(t))
    /\ Set(granted, t, {})
    /\ UNCHANGED <<srv, epoch, lostS, wrote, acked, missed, completed, fresh>>

\* RenewLease: the renewer thread (Fleet._renew) renews one lease still believed held (LeaseTable.renew_lease): a
\* request and its answer, atomic here.  A renewal that is lost or late is a renewal not made: Tick may always come
\* first.  The server renews a lease it honours and answers 410 for any other, and the trainer then counts that
\* lease lost.
RenewLease(t, s) ==
    /\ trainer[t] \in {"holding", "writing"} /\ s \in granted[t] \ lostS[t]
    /\ \/ Renew(s, epoch[t]) /\ UNCHANGED lostS
       \/ RenewRefused(s, epoch[t]) /\ Set(lostS, t, lostS[t] \cup {s})
    /\ UNCHANGED <<trainer, epoch, granted, wrote, acked, missed, net, completed, fresh>>

\* Fleet.update_weights_from_disk(): only with every server's lease granted; not to a server whose lease was lost.
TrainerWrite(t) ==
    /\ trainer[t] = "holding" /\ ~wrote[t]
    /\ Set(wrote, t, TRUE)
    /\ Send({[t |-> IF Broadcast THEN "bwrite" ELSE "write", s |-> s, e |-> epoch[t]] : s \in Servers \ lostS[t]})
    /\ Set(trainer, t, "writing") /\ Set(acked, t, {}) /\ Set(missed, t, lostS[t])
    /\ UNCHANGED <<srv, epoch, granted, lostS, completed, fresh>>

TrainerWriteAnswer(m) ==
    LET t == Owner(m.e) IN
    /\ m \in net /\ m.t = "wok" /\ trainer[t] = "writing" /\ m.e = epoch[t]
    /\ Set(acked, t, acked[t] \cup {m.s})
    /\ net' = net \ {m}
    /\ UNCHANGED <<srv, trainer, epoch, granted, lostS, wrote, missed, completed, fresh>>

\* The write's result: every answer came, or the trainer stops waiting; a server without an acknowledgement is
\* reported as having missed the update (FleetError), and only an update every server took is complete.
TrainerWriteDone(t) ==
    /\ trainer[t] = "writing"
    /\ Set(missed, t, Servers \ acked[t])
    /\ completed' = IF acked[t] = Servers THEN epoch[t] ELSE completed
    /\ Set(trainer, t, "release")
    /\ UNCHANGED <<srv, net, epoch, granted, lostS, wrote, acked, fresh>>

\* The end of the with block: every lease granted is resumed.
TrainerRelease(t) ==
    /\ trainer[t] \in {"holding", "release"}
    /\ Send({[t |-> "resume", s |-> s, e |-> epoch[t]] : s \in granted[t]})
    /\ Set(trainer, t, After(t))
    /\ UNCHANGED <<srv, epoch, granted, lostS, wrote, acked, missed, completed, fresh>>

\* The trainer's process dies: what it knew dies with it, and so do the answers on their way to it.
TrainerCrash(t) ==
    /\ trainer[t] \notin {"done", "crashed"}
    /\ Set(trainer, t, "crashed")
    /\ Set(granted, t, {}) /\ Set(lostS, t, {}) /\ Set(acked, t, {}) /\ Set(missed, t, {})
    /\ net' = {m \in net : m.t \notin ToTrainer \/ Owner(m.e) # t}
    /\ UNCHANGED <<srv, epoch, wrote, completed, fresh>>

\* The trainer's process hangs: it takes no step any more (no renewal, no resume), and its connections stay open.
TrainerHang(t) ==
    /\ trainer[t] \notin {"done", "crashed", "hung"}
    /\ Set(trainer, t, "hung")
    /\ UNCHANGED <<srv, net, epoch, granted, lostS, wrote, acked, missed, completed, fresh>>

----------------------------------------------------------------------------
\* The servers (cbpause serve; cbpause.serve.leases.LeaseTable)

\* PauseLease: the message asking for a lease, and the grant's answer.
PauseLease(m) ==
    /\ m \in net /\ m.t = "pause"
    /\ Grant(m.s, m.e)
    /\ Answer(m, [t |-> "grant", s |-> m.s, e |-> m.e])
    /\ UNCHANGED <<trn, completed, fresh>>

\* WriteBegin (LeaseTable.write_weights): under the writer's own lease honoured now, and (WriteOrder) not under a lease
\* older than the one that wrote last; one write at a time per server (the route's thread).  A refusal (410, 409)
\* reaches the trainer as no acknowledgement: it reports that server as having missed the write whether it heard the
\* refusal or stopped waiting (TrainerWriteDone), so the model leaves the refusal's answer out.
WriteBegin(m) ==
    /\ m \in net /\ m.t \in {"write", "bwrite"}
    /\ StartWrite(m.s, m.e, IF m.t = "bwrite" THEN "receiving" ELSE "copying") \/ WriteRefused(m.s, m.e)
    /\ net' = net \ {m}
    /\ UNCHANGED <<trn, completed, fresh>>

\* The model is untouched by the write under way: a transfer that has copied nothing yet.
Untouched(s) == stage[s] = "receiving"

\* Received (LeaseTable.received): the copy into the model begins.  Staged: every bucket arrived whole into the staging
\* buffers, and every member of the group said so (cbpause.serve.distributed's second vote).  Bounded (Staged = FALSE):
\* the first bucket arrived whole, and its copy begins.  The transfer needs its trainer sending (Next), so a trainer
\* that stopped, crashed or hung leaves its transfers to fail or be cut; with bounded staging so does the rest of it
\* after Received (WriteEnd in Next).
Received(s) ==
    /\ up[s] /\ writing[s] # 0 /\ stage[s] = "receiving"
    /\ stage' = [stage EXCEPT ![s] = "copying"]
    /\ UNCHANGED <<up, lease, ttl, ver, wroteEp, seq, nseq, writing, wtime, serverCrashes, losses, trn, net, completed,
                   fresh>>

\* WriteEnd (LeaseTable.commit_write): the copy finished before the write's deadline; the version is set and the
\* trainer answered.  Nothing makes it happen: a write may hang for ever (WriteCut then ends it).
WriteEnd(s) ==
    /\ up[s] /\ writing[s] # 0 /\ stage[s] = "copying"
    /\ ver' = [ver EXCEPT ![s] = writing[s]]
    /\ stage' = [stage EXCEPT ![s] = "none"]
    /\ fresh' = [fresh EXCEPT ![s] = TRUE]
    /\ writing' = [writing EXCEPT ![s] = 0]
    /\ net' = net \cup (IF trainer[Owner(writing[s])] = "crashed" THEN {} ELSE {[t |-> "wok", s |-> s, e |-> writing[s]]})
    /\ UNCHANGED <<up, lease, ttl, wroteEp, seq, nseq, wtime, serverCrashes, losses, trn, completed>>

\* WriteCut (LeaseTable._cut, _label_partial): the write passed its deadline.  Its lease ends without it (its thread
\* ends without leaving, as an expired lease's; a resumed lease is already gone), and the weights, a mix, are
\* labelled Partial while the hold is still in place.  The route answers 410: no acknowledgement.
WriteCut(s) ==
    /\ up[s] /\ writing[s] # 0 /\ wtime[s] = 0
    /\ IF Untouched(s)
       THEN UNCHANGED <<ver, fresh>>
       ELSE ver' = [ver EXCEPT ![s] = Partial(writing[s])] /\ fresh' = [fresh EXCEPT ![s] = TRUE]
    /\ stage' = [stage EXCEPT ![s] = "none"]
    /\ lease' = [lease EXCEPT ![s][writing[s]] = IF @ = "held" THEN "dead" ELSE @]
    /\ writing' = [writing EXCEPT ![s] = 0]
    /\ UNCHANGED <<up, ttl, wroteEp, seq, nseq, wtime, serverCrashes, losses, trn, net, completed>>

\* WriteFail (LeaseTable.fail_write): the copy failed before its end (an error, not the deadline): the write ends, its
\* lease still held; the weights keep their label if nothing was copied, and are labelled Partial if some tensors were
\* (a mix).  The route answers an error: no acknowledgement.  Nothing makes it happen.
WriteFail(s) ==
    /\ up[s] /\ writing[s] # 0
    /\ \/ UNCHANGED <<ver, fresh>>
       \/ ~Untouched(s) /\ ver' = [ver EXCEPT ![s] = Partial(writing[s])] /\ fresh' = [fresh EXCEPT ![s] = TRUE]
    /\ stage' = [stage EXCEPT ![s] = "none"]
    /\ writing' = [writing EXCEPT ![s] = 0]
    /\ UNCHANGED <<up, lease, ttl, wroteEp, seq, nseq, wtime, serverCrashes, losses, trn, net, completed>>

WriteTick(s) ==
    /\ up[s] /\ writing[s] # 0 /\ wtime[s] > 0
    /\ wtime' = [wtime EXCEPT ![s] = @ - 1]
    /\ UNCHANGED <<up, lease, ttl, ver, wroteEp, seq, nseq, writing, stage, serverCrashes, losses, trn, net, completed, fresh>>

\* ResumeLease: the message, taken once no write runs under its lease (the resume waits for the write's end or cut).
ResumeLease(m) ==
    /\ m \in net /\ m.t = "resume"
    /\ EndLease(m.s, m.e)
    /\ net' = net \ {m}
    /\ UNCHANGED <<trn, completed, fresh>>

Tick(s, e) ==
    /\ Leased /\ up[s] /\ lease[s][e] = "held" /\ ttl[s][e] > 0
    /\ ttl' = [ttl EXCEPT ![s][e] = @ - 1]
    /\ UNCHANGED <<up, lease, ver, wroteEp, seq, nseq, writing, wtime, stage, serverCrashes, losses, trn, net, completed, fresh>>

\* LeaseExpires = PauseProtocol's HolderDies: the lease's thread ends without leaving; the lease is honoured no more.
\* Not while a write runs under it (WriteCut ends that one).
LeaseExpires(s, e) ==
    /\ Leased /\ up[s] /\ lease[s][e] = "held" /\ ttl[s][e] = 0 /\ writing[s] # e
    /\ lease' = [lease EXCEPT ![s][e] = "dead"]
    /\ UNCHANGED <<up, ttl, ver, wroteEp, seq, nseq, writing, wtime, stage, serverCrashes, losses, trn, net, completed, fresh>>

\* ReleaseDeadHolder: the loop, parked in its window, drops the dead holder's hold.
ReleaseDeadHolder(s, e) ==
    /\ up[s] /\ lease[s][e] = "dead"
    /\ lease' = [lease EXCEPT ![s][e] = "gone"]
    /\ UNCHANGED <<up, ttl, ver, wroteEp, seq, nseq, writing, wtime, stage, serverCrashes, losses, trn, net, completed, fresh>>

\* A server's process dies: its pauses die with it; lease ids are never issued twice, so its old leases stay gone.
ServerCrash(s) ==
    /\ up[s] /\ serverCrashes < MaxRestarts
    /\ up' = [up EXCEPT ![s] = FALSE]
    /\ serverCrashes' = serverCrashes + 1
    /\ lease' = [lease EXCEPT ![s] = [e \in Epochs |-> IF @[e] = "none" THEN "none" ELSE "gone"]]
    /\ writing' = [writing EXCEPT ![s] = 0]
    /\ stage' = [stage EXCEPT ![s] = "none"]
    /\ UNCHANGED <<ttl, ver, wroteEp, seq, nseq, wtime, losses, trn, net, completed, fresh>>

ServerRestart(s) ==
    /\ ~up[s]
    /\ up' = [up EXCEPT ![s] = TRUE]
    /\ ver' = [ver EXCEPT ![s] = 0]
    /\ wroteEp' = [wroteEp EXCEPT ![s] = 0]
    /\ fresh' = [fresh EXCEPT ![s] = FALSE]
    /\ UNCHANGED <<lease, ttl, seq, nseq, writing, wtime, stage, serverCrashes, losses, trn, net, completed>>

\* The network loses a message (within the budget), or the server it goes to is down (always).
Undeliverable(m) ==
    /\ m \in net /\ m.t \notin ToTrainer /\ ~up[m.s]
    /\ net' = net \ {m}
    /\ UNCHANGED <<srv, trn, completed, fresh>>

Lose(m) ==
    /\ m \in net /\ losses < MaxLosses
    /\ net' = net \ {m}
    /\ losses' = losses + 1
    /\ UNCHANGED <<up, lease, ttl, ver, wroteEp, seq, nseq, writing, wtime, stage, serverCrashes, trn, completed, fresh>>

Server(m) == PauseLease(m) \/ WriteBegin(m) \/ ResumeLease(m)

Time(s, e) == Tick(s, e) \/ LeaseExpires(s, e) \/ ReleaseDeadHolder(s, e)

WriteTime(s) == WriteTick(s) \/ WriteCut(s)

\* One disjunct per action, so that TLC's coverage names each one.
Next ==
    \/ \E t \in Trainers : TrainerPause(t)
    \/ \E t \in Trainers : TrainerPauseFails(t)
    \/ \E t \in Trainers : TrainerWrite(t)
    \/ \E t \in Trainers : TrainerWriteDone(t)
    \/ \E t \in Trainers : TrainerRelease(t)
    \/ \E t \in Trainers : TrainerCrash(t)
    \/ \E t \in Trainers : TrainerHang(t)
    \/ \E t \in Trainers, s \in Servers : RenewLease(t, s)
    \/ \E m \in net : TrainerGranted(m)
    \/ \E m \in net : TrainerDrops(m)
    \/ \E m \in net : TrainerWriteAnswer(m)
    \/ \E m \in net : PauseLease(m)
    \/ \E m \in net : WriteBegin(m)
    \/ \E s \in Servers : writing[s] # 0 /\ (Staged \/ ~Broadcast \/ trainer[Owner(writing[s])] = "writing") /\ WriteEnd(s)
    \/ \E s \in Servers : writing[s] # 0 /\ trainer[Owner(writing[s])] = "writing" /\ Received(s)
    \/ \E s \in Servers : WriteFail(s)
    \/ \E s \in Servers : WriteTick(s)
    \/ \E s \in Servers : WriteCut(s)
    \/ \E m \in net : ResumeLease(m)
    \/ \E m \in net : Lose(m)
    \/ \E m \in net : Undeliverable(m)
    \/ \E s \in Servers, e \in Epochs : Tick(s, e)
    \/ \E s \in Servers, e \in Epochs : LeaseExpires(s, e)
    \/ \E s \in Servers, e \in Epochs : ReleaseDeadHolder(s, e)
    \/ \E s \in Servers : ServerCrash(s)
    \/ \E s \in Servers : ServerRestart(s)

\* Fairness, each a claim about the code (spec section 6.6): a server answers every request it receives (uvicorn's
\* event loop and worker threads: control.py's routes); a lease's countdown runs and its expiry is seen (the lease
\* thread's timed wait, LeaseTable._hold); the loop releases a dead holder (LoopSteps.pause_window's HOLDER_CHECK_S).
\* A write's countdown runs and its cut comes (the lease thread's timed wait ends at the write's deadline,
\* LeaseTable._hold, and _look cuts it).  Nothing is fair for the trainer, a write's end (WriteEnd: a copy may hang),
\* the network's losses or the crashes: they may stop, or never happen.
Fairness ==
    /\ \A m \in Msgs : WF_vars(Server(m))
    /\ \A s \in Servers, e \in Epochs : WF_vars(Time(s, e))
    /\ \A s \in Servers : WF_vars(WriteTime(s))

Spec == Init /\ [][Next]_vars /\ Fairness

----------------------------------------------------------------------------
\* Properties

\* No lease keeps a server paused for ever once the trainers stop renewing (each crashed, hung, or is done), even when a
\* write under a lease never ends: every server runs, but one whose weights are torn, which waits for a complete write
\* (issue 57: nobody else can mend them; its hold is not a lease's).
NoPausedForEverProp ==
    []((\A t \in Trainers : trainer[t] \in {"crashed", "hung", "done"}) => <>[](\A s \in Servers : Paused(s) => Torn(s)))

\* Issue 57: torn weights (a write stopped after its first tensor) are never served: a server that steps its loop holds
\* whole weights, of one update.
TornNeverServed == \A s \in Servers : Serving(s) => ver[s] <= MaxEpoch

\* ... and a torn server stops refusing only by a complete write (WriteEnd), or by a crash (its restart loads the
\* checkpoint): no failed, cut or refused write, no lease's end, mends it.
TornMendedOnlyByWrite ==
    [][\A s \in Servers : (Torn(s) /\ up'[s] /\ ~Torn(s)') => writing[s] # 0 /\ writing'[s] = 0 /\ ver'[s] = writing[s]]_vars

\* A write is honoured only under a lease held now (never an expired one), and changes the version only so.
WriteUnderLease ==
    [][\A s \in Servers : (up[s] /\ up'[s] /\ ver'[s] # ver[s]) => \E e \in Epochs : Honoured(s, e)]_vars

\* Sharper (issue 39, point 12): the version changes only under the writer's own lease, held until that step: no write
\* is applied after the writer's own lease ended.  A server that honours any held lease passes WriteUnderLease and
\* fails this (FleetPause_any_lease).
OwnLeaseWrite ==
    [][\A s \in Servers : (up[s] /\ up'[s] /\ ver'[s] # ver[s]) =>
                              Of(ver'[s]) > 0 /\ lease[s][Of(ver'[s])] = "held"]_vars

\* Issue 42: a transfer that fails (a peer lost, a deadline, a member's refusal, the trainer gone) leaves the weights
\* and their label as they were: while a server receives, its version changes only by a crash and restart.
TransferFailureKeepsWeights ==
    [][\A s \in Servers : (stage[s] = "receiving" /\ up'[s]) => ver'[s] = ver[s]]_vars

\* A lease that expired or was resumed is never honoured again.
GoneStaysGone ==
    [][\A s \in Servers, e \in Epochs :
         /\ lease[s][e] = "gone" => lease'[s][e] = "gone"
         /\ lease[s][e] = "dead" => lease'[s][e] \in {"dead", "gone"}]_vars

\* A trainer writes only holding every server's lease (as granted), and its report is true: a server it counts
\* as updated took the version (and no older pause of its own overwrote it since; another trainer's may have, once
\* its lease there ended: NoMixedWhileComplete says when not).
WriteOnlyHoldingInv == \A t \in Trainers : trainer[t] \in {"writing", "release"} => granted[t] = Servers
ReportTruthfulInv ==
    \A t \in Trainers : trainer[t] = "release" =>
        /\ missed[t] = Servers \ acked[t]
        /\ \A s \in acked[t] : up[s] /\ fresh[s] /\ Owner(wroteEp[s]) = t => (wroteEp[s] >= epoch[t] \/ ~WriteOrder)

\* After a completed update every live server that has not restarted since it took it reports that version or a
\* newer one.  (A server that serverCrashes comes back with its checkpoint's weights, version 0, and says so: its lease
\* ids are unknown to the new process, so the trainer's resume gets a 404; Fleet.status() shows its version.)
\* A write cut at its deadline leaves its partial label, which names the update: it counts as that update's (newer than
\* the completed one), truthfully labelled.
\* With several trainers, "newer" is among one trainer's pauses: another trainer's update may follow a completed one.
CompletedUpdateVisible ==
    \A s \in Servers : (up[s] /\ fresh[s] /\ Owner(Of(ver[s])) \in {0, Owner(completed)}) => Of(ver[s]) >= completed

\* Issue 39, point 13: a trainer told its update is complete (every server acknowledged it) finds every server
\* generating with it for as long as it holds that pause's leases: another trainer's write in between is refused
\* (the fence), so the fleet is never mixed while a trainer that holds it is told it is not.  A lease that ends
\* (expired: a trainer too slow to renew, whose renewer then reports it lost) lets the next writer in.
\* Per server, the same from the trainer's first acknowledgement: the weights a server acknowledged to a trainer stand
\* there while the trainer holds that lease.  The servers never talk to each other, so NoMixedWhileComplete is the
\* conjunction of this over the servers (docs/tlc.md: why one server checks the fence).
AckedWriteStands ==
    \A t \in Trainers, s \in Servers :
        (trainer[t] \in {"writing", "release"} /\ s \in acked[t] /\ lease[s][epoch[t]] = "held") => ver[s] = epoch[t]
NoMixedWhileComplete ==
    \A t \in Trainers :
        (trainer[t] = "release" /\ acked[t] = Servers /\ \A s \in Servers : lease[s][epoch[t]] = "held")
            => \A s \in Servers : ver[s] = epoch[t]

\* A state constraint for the safety models of two trainers on two servers: no trainer crashes or hangs.  For safety
\* it loses nothing: no trainer step is fair, so every prefix in which a trainer stops is explored anyway, and its
\* leases expire (Tick) as a crashed trainer's do; a crash only withholds the answers to it.
NoTrainerFaults == \A t \in Trainers : trainer[t] \notin {"crashed", "hung"}

\* Witnesses: the model reaches a completed update, and a lease that expires.
NeverCompletesWitness == completed = 0
NeverExpiresWitness == \A s \in Servers, e \in Epochs : lease[s][e] # "dead"
\* ... and a write cut at its deadline.
NeverCutWitness == \A s \in Servers : ver[s] <= MaxEpoch
\* ... and (by broadcast) a transfer that arrives, and one cut or failed while receiving.
NeverReceivedWitness == \A s \in Servers : stage[s] # "copying" \/ ~Broadcast
\* ... and (two trainers) a write the fence refuses, and a trainer told its update is complete while holding.
NeverFencedWitness ==
    ~\E m \in net : m.t = "write" /\ up[m.s] /\ writing[m.s] = 0 /\ WriteHonoured(m.s, m.e) /\ InOrder(m.s, m.e)
                   /\ ~Unfenced(m.s, m.e)
NeverToldCompleteWitness ==
    ~\E t \in Trainers : trainer[t] = "release" /\ acked[t] = Servers /\ \A s \in Servers : lease[s][epoch[t]] = "held"
=============================================================================
