#include "viz/report.hpp"

#include "attn/core/error.hpp"
#include "viz/io.hpp"
#include "viz/svg.hpp"

#include <algorithm>

namespace attn::viz {

std::string inline_markup(const std::string& text) {
  std::string out;
  size_t i = 0;
  while (i < text.size()) {
    const size_t open = text.find('`', i);
    const size_t close = open == std::string::npos ? open : text.find('`', open + 1);
    if (close == std::string::npos) {
      out += xml_escape(std::string_view(text).substr(i));
      break;
    }
    out += xml_escape(std::string_view(text).substr(i, open - i));
    out += "<code>" + xml_escape(std::string_view(text).substr(open + 1, close - open - 1)) +
           "</code>";
    i = close + 1;
  }
  return out;
}

Section::Section(std::string id, std::string title) : id_(std::move(id)), title_(std::move(title)) {
  check(!id_.empty() && std::all_of(id_.begin(), id_.end(),
                                    [](char c) {
                                      return (c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') ||
                                             c == '-';
                                    }),
        "report", "section id '{}' must be non-empty [a-z0-9-]", id_);
}

Section& Section::paragraph(std::string text) {
  blocks_.emplace_back(Paragraph{std::move(text)});
  return *this;
}

Section& Section::figure(std::string src, std::string caption, std::string alt) {
  check(!src.empty(), "report", "figure without a source in section '{}'", id_);
  blocks_.emplace_back(Figure{std::move(src), std::move(caption), std::move(alt)});
  return *this;
}

Section& Section::table(Table t) {
  for (const auto& row : t.rows) {
    check(row.size() == t.header.size(), "report",
          "table row has {} cells, its header {} (section '{}')", row.size(), t.header.size(), id_);
  }
  blocks_.emplace_back(std::move(t));
  return *this;
}

Section& Section::preformatted(std::string text) {
  blocks_.emplace_back(Preformatted{std::move(text)});
  return *this;
}

std::vector<std::string> Section::figure_sources() const {
  std::vector<std::string> out;
  for (const auto& b : blocks_) {
    if (const auto* f = std::get_if<Figure>(&b)) out.push_back(f->src);
  }
  return out;
}

std::string Section::html() const {
  std::string out = fmt::format("<section id=\"{}\">\n<h2>{}</h2>\n", id_, xml_escape(title_));
  for (const auto& block : blocks_) {
    if (const auto* p = std::get_if<Paragraph>(&block)) {
      out += fmt::format("<p>{}</p>\n", inline_markup(p->text));
    } else if (const auto* f = std::get_if<Figure>(&block)) {
      out += fmt::format("<figure>\n<img src=\"{}\" alt=\"{}\">\n", xml_escape(f->src),
                         xml_escape(f->alt.empty() ? f->caption : f->alt));
      if (!f->caption.empty())
        out += fmt::format("<figcaption>{}</figcaption>\n", inline_markup(f->caption));
      out += "</figure>\n";
    } else if (const auto* t = std::get_if<Table>(&block)) {
      out += "<table>\n";
      if (!t->caption.empty())
        out += fmt::format("<caption>{}</caption>\n", inline_markup(t->caption));
      out += "<thead><tr>";
      for (const auto& h : t->header)
        out += fmt::format("<th>{}</th>", inline_markup(h));
      out += "</tr></thead>\n<tbody>\n";
      for (const auto& row : t->rows) {
        out += "<tr>";
        for (const auto& cell : row)
          out += fmt::format("<td>{}</td>", inline_markup(cell));
        out += "</tr>\n";
      }
      out += "</tbody>\n</table>\n";
    } else if (const auto* pre = std::get_if<Preformatted>(&block)) {
      out += fmt::format("<pre>{}</pre>\n", xml_escape(pre->text));
    }
  }
  out += "</section>\n";
  return out;
}

Report::Report(std::string title) : title_(std::move(title)) {}

Report& Report::intro(std::string text) {
  intro_.push_back(std::move(text));
  return *this;
}

Section& Report::section(std::string id, std::string title) {
  for (const Section& s : sections_) {
    check(s.id() != id, "report", "duplicate section id '{}'", id);
  }
  sections_.emplace_back(std::move(id), std::move(title));
  return sections_.back();
}

std::string Report::html() const {
  // Self-contained page: inline CSS, no scripts, figures as sibling files.
  std::string out = fmt::format(
      "<!DOCTYPE html>\n<html lang=\"en\">\n<head>\n<meta charset=\"utf-8\">\n"
      "<meta name=\"viewport\" content=\"width=device-width, initial-scale=1\">\n"
      "<title>{}</title>\n<style>\n"
      "body {{ font-family: system-ui, -apple-system, 'Segoe UI', sans-serif; max-width: 960px; "
      "margin: 2em auto; padding: 0 1em; line-height: 1.5; color: #222; }}\n"
      "h1 {{ font-size: 1.8em; }} h2 {{ border-bottom: 1px solid #ddd; padding-bottom: .2em; "
      "margin-top: 2em; }}\n"
      "figure {{ margin: 1.2em 0; }} figure img {{ max-width: 100%; height: auto; }}\n"
      "figcaption {{ color: #555; font-size: .92em; }}\n"
      "table {{ border-collapse: collapse; margin: 1em 0; font-size: .92em; }}\n"
      "caption {{ text-align: left; color: #555; padding-bottom: .3em; }}\n"
      "th, td {{ border: 1px solid #ccc; padding: .25em .6em; text-align: left; }}\n"
      "th {{ background: #f3f6fa; }} tbody tr:nth-child(even) {{ background: #fafafa; }}\n"
      "code, pre {{ font-family: ui-monospace, 'DejaVu Sans Mono', monospace; }}\n"
      "pre {{ background: #f6f8fa; padding: .8em; overflow-x: auto; }}\n"
      "nav ol {{ columns: 2; }}\n"
      "</style>\n</head>\n<body>\n<h1>{}</h1>\n",
      xml_escape(title_), xml_escape(title_));
  for (const auto& p : intro_)
    out += fmt::format("<p>{}</p>\n", inline_markup(p));
  if (!sections_.empty()) {
    out += "<nav>\n<ol>\n";
    for (const Section& s : sections_)
      out += fmt::format("<li><a href=\"#{}\">{}</a></li>\n", s.id(), xml_escape(s.title()));
    out += "</ol>\n</nav>\n";
  }
  for (const Section& s : sections_)
    out += s.html();
  out += "</body>\n</html>\n";
  return out;
}

void Report::write(const std::string& path) const {
  write_file_atomic(path, html());
}

}  // namespace attn::viz
