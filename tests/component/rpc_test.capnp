@0xb8d6f2a3c4e5f601;

interface Echo {
  echo @0 (text :Text) -> (text :Text);
  hang @1 (token :Text) -> ();
  callback @2 (cb :Callback, value :UInt32) -> (result :UInt32);
  child @3 (name :Text) -> (child :Echo);
  blob @4 (data :Data) -> (size :UInt64);
  fail @5 (message :Text) -> ();
  name @6 () -> (name :Text);
}

interface Callback {
  call @0 (value :UInt32) -> (result :UInt32);
}
