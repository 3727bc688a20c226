// A model directory's tokenizer_config.json (its special tokens: bos / eos / pad as
// strings or AddedToken objects), next to a small valid tokenizer.json, loaded as
// `train --tokenizer auto` loads a model directory, then a text encoded.
#include "autotp/tokenizer/text_tokenizer.h"
#include "fuzz_common.h"

namespace {

// 120 byte-level tokens, no merges, and <s> = 120, </s> = 121 as added tokens.
constexpr const char* kTokenizerJson = R"json({"version":"1.0","truncation":null,"padding":null,"added_tokens":[{"id":120,"content":"<s>","single_word":false,"lstrip":false,"rstrip":false,"normalized":false,"special":true},{"id":121,"content":"</s>","single_word":false,"lstrip":false,"rstrip":false,"normalized":false,"special":true}],"normalizer":null,"pre_tokenizer":{"type":"ByteLevel","add_prefix_space":false,"trim_offsets":true,"use_regex":true},"post_processor":null,"decoder":{"type":"ByteLevel","add_prefix_space":true,"trim_offsets":true,"use_regex":true},"model":{"type":"BPE","dropout":null,"unk_token":null,"continuing_subword_prefix":"","end_of_word_suffix":"","fuse_unk":false,"byte_fallback":false,"ignore_merges":false,"vocab":{"!":0,"\"":1,"#":2,"$":3,"%":4,"&":5,"'":6,"(":7,")":8,"*":9,"+":10,",":11,"-":12,".":13,"/":14,"0":15,"1":16,"2":17,"3":18,"4":19,"5":20,"6":21,"7":22,"8":23,"9":24,":":25,";":26,"<":27,"=":28,">":29,"?":30,"@":31,"A":32,"B":33,"C":34,"D":35,"E":36,"F":37,"G":38,"H":39,"I":40,"J":41,"K":42,"L":43,"M":44,"N":45,"O":46,"P":47,"Q":48,"R":49,"S":50,"T":51,"U":52,"V":53,"W":54,"X":55,"Y":56,"Z":57,"[":58,"\\":59,"]":60,"^":61,"_":62,"`":63,"a":64,"b":65,"c":66,"d":67,"e":68,"f":69,"g":70,"h":71,"i":72,"j":73,"k":74,"l":75,"m":76,"n":77,"o":78,"p":79,"q":80,"r":81,"s":82,"t":83,"u":84,"v":85,"w":86,"x":87,"y":88,"z":89,"{":90,"|":91,"}":92,"~":93,"¡":94,"¢":95,"£":96,"¤":97,"¥":98,"¦":99,"§":100,"¨":101,"©":102,"ª":103,"«":104,"¬":105,"®":106,"¯":107,"°":108,"±":109,"²":110,"³":111,"´":112,"µ":113,"¶":114,"·":115,"¸":116,"¹":117,"º":118,"»":119},"merges":[]}})json";

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace autotp;
  const auto dir = autotp::fuzz::scratch_dir();
  static const bool written = (autotp::fuzz::write_file(dir / "tokenizer.json", kTokenizerJson), true);
  (void)written;
  fuzz::write_file(dir / "tokenizer_config.json", data, size);
  std::shared_ptr<const tok::TextTokenizer> tokenizer;
  fuzz::expect_user_error_only("tokenizer_config.json", [&] { tokenizer = tok::load_model_tokenizer(dir.string()); });
  if (!tokenizer) return 0;
  fuzz::expect_user_error_only("", [&] {
    std::vector<int64_t> ids;
    tokenizer->encode("Hello <s> world </s>!", ids);
    for (const auto* special : {&tokenizer->bos_id, &tokenizer->eos_id, &tokenizer->pad_id})
      if (special->has_value()) ids.push_back(**special);
    for (int64_t id : ids)
      if (id < 0 || id >= tokenizer->vocab_size())
        fuzz::finding("id out of range", "encode gave id " + std::to_string(id) + " outside [0, vocab_size " +
                                             std::to_string(tokenizer->vocab_size()) + ")");
  });
  return 0;
}
